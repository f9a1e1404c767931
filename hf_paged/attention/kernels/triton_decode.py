"""Triton paged decode attention: one new token per sequence against its K/V in the block pool.

Reference: `reference.paged_decode_attention_torch` (same signature, same semantics).

Design, for memory bandwidth (decode reads every cached K/V byte once and does little math per byte):
- one program per (sequence, kv head, split) handles the GQA group of q heads that share the kv head, 16 at a time
  (a group of up to 16 in one program), so each K/V tile is read from HBM once per group, not once per q head;
- the program walks the sequence in tiles of `BLOCK_N` tokens; for each tile it gathers the block ids from the
  block table (one tile ahead with 3 pipeline stages, so that two tiles' K/V are in flight) and loads a
  `[BLOCK_N, head_dim]` tile of K and of V (rows are contiguous `head_dim` vectors in the NHD layout, so every row
  load is coalesced whatever the block size);
- online softmax in fp32 (exp2 with the scale folded into log2(e)), `tl.dot` for QK^T and PV with the group dim
  padded to 16 rows (tensor cores for fp16/bf16);
- split-K ("flash decoding"): when batch * num_kv_heads programs cannot fill the GPU, each sequence's visible keys
  are cut into `num_splits` chunks processed in parallel; each writes a normalized partial output and its
  log-sum-exp, and a second small kernel merges them. The chunks are cut from each sequence's own length, read on
  the device (equal runs of whole tiles, none shorter than the launch's `min_chunk`), not from the block table's
  width: a table wider than its rows (CUDA graphs' and a compiled cache's, as wide as the rows may grow) or a
  sliding window leaves no split idle that the row's keys could keep busy.

Tile sizes, warps and stages come from `launch_config` (a function of head_dim, dtype and the GPU's compute
capability, chosen so that no variant spills registers); group, block size, window and split count are runtime
arguments, so one compiled variant per (dtype, head_dim tile, softcap) serves every model and step.

Import this module only through `hf_paged.kernels` (lazily): `triton.jit` reads `TRITON_INTERPRET` when the
kernels below are defined.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from . import launch_config
from .direct import DirectKernel, int_keys, pointer_keys
from .reference import check_decode_args

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)
NO_WINDOW = 1 << 30  # the sliding_window argument without a window: wider than any sequence


@triton.jit
def fp32_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`tl.dot(a, b)` in fp32; UPCAST first widens bf16 inputs, because Triton's CPU interpreter multiplies the raw
    uint16 bits of bf16 operands (GPU builds never set it)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def block_index(pos, block_size, block_shift, SLOT_ROWS: tl.constexpr):
    """The block table entry holding each position `pos` (>= 0): with SLOT_ROWS (a power-of-two block size) a shift by
    `block_shift`, else an integer division, which a runtime divisor makes a reciprocal and several integer
    instructions per element in every tile."""
    if SLOT_ROWS:
        return pos >> block_shift
    return pos // block_size


@triton.jit
def block_offset(pos, block_size, SLOT_ROWS: tl.constexpr):
    """Each position's offset in its block (`pos % block_size`; a mask with SLOT_ROWS)."""
    if SLOT_ROWS:
        return pos & (block_size - 1)
    return pos % block_size


@triton.jit
def pool_block_ids(ids, SLOT_ROWS: tl.constexpr):
    """Block ids read from a block table, in the width `load_kv_tile` takes them: int32 with SLOT_ROWS (a slot of the
    pool fits in 32 bits), else int64 (their products with the block stride do not)."""
    if SLOT_ROWS:  # a constexpr branch: one of the two is compiled, and returns one type
        block_ids = ids.to(tl.int32)
    else:
        block_ids = ids.to(tl.int64)
    return block_ids


@triton.jit
def tile_slots(bt_row, pos, in_range, block_size, block_shift, SLOT_ROWS: tl.constexpr):
    """(pool block id, offset in it) of each position `pos` of a tile, through the sequence's block table row
    `bt_row` (the ids as `pool_block_ids` gives them); positions out of `in_range` read entry 0 (their K/V are
    masked)."""
    block_idx = block_index(pos, block_size, block_shift, SLOT_ROWS)
    block_ids = pool_block_ids(tl.load(bt_row + block_idx, mask=in_range, other=0), SLOT_ROWS)
    if SLOT_ROWS:
        offsets = block_offset(pos, block_size, SLOT_ROWS)
    else:  # the quotient's remainder: no second division
        offsets = pos - block_idx * block_size
    return block_ids, offsets


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_ids,
    offsets,
    kv_head,
    d,
    mask,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    block_size,
    SLOT_ROWS: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM_PAD] rows of a K or V cache ([num_blocks, block_size, kv_heads, head_dim] strides) at the
    tile's slots, for kv head `kv_head`; zeros where `mask` is off. Rows are contiguous head_dim vectors (NHD), so
    every row load is coalesced whatever the block size.

    With SLOT_ROWS a block's slots are consecutive rows of the cache (`stride_b == block_size * stride_s`, a
    power-of-two block size, the pool's slots under 2**31): a row is its slot `block_id * block_size + offset`,
    one 32-bit multiply-add, times `stride_s`, one widening multiply; otherwise each row costs two 64-bit products
    (`block_id * stride_b`, whose sum overflows 32 bits in a large pool), a dozen integer instructions more a row."""
    if SLOT_ROWS:
        slots = block_ids * block_size + offsets  # one multiply-add
        return tl.load(
            cache_ptr + slots[:, None].to(tl.int64) * stride_s + kv_head * stride_h + d[None, :] * stride_d,
            mask=mask,
            other=0.0,
        )
    return tl.load(
        cache_ptr
        + block_ids[:, None] * stride_b
        + offsets[:, None] * stride_s
        + kv_head * stride_h
        + d[None, :] * stride_d,
        mask=mask,
        other=0.0,
    )


@triton.jit
def softcap_logits(logits, softcap):
    """`softcap * tanh(logits / softcap)`: tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], no overflow
    for any x."""
    x = logits / softcap
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    tanh_abs = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0.0, -tanh_abs, tanh_abs)


# NOTE: Triton compiles a variant per value class of each int argument (1, divisible by 16, other) unless told not
# to. Sizes that vary with the model or the workload (block table width, GQA group, block size, window) are excluded,
# so one variant per (dtype, head_dim_pad, softcap) serves every model and step; head_dim stays specialized, because
# knowing it is a multiple of 16 is what lets the loads of its rows vectorize.
@triton.jit(do_not_specialize=["stride_bt", "sliding_window", "group", "block_size", "block_shift", "has_kv_start"])
def _paged_decode_kernel(
    q_ptr,  # [B, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    seq_lens_ptr,  # [B]
    kv_start_ptr,  # [B], read only if has_kv_start
    out_ptr,  # [B, num_q_heads, head_dim], written when the grid has one split
    partial_out_ptr,  # [B, num_q_heads, num_splits, head_dim] fp32 contiguous, written when it has more
    partial_lse_ptr,  # [B, num_q_heads, num_splits] fp32 contiguous (log2 units), written when it has more
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
    sliding_window,  # larger than any sequence when there is no window
    min_chunk,  # the fewest tokens a split of a sequence takes (a multiple of BLOCK_N)
    group,  # q heads per kv head
    head_dim,
    block_size,
    block_shift,  # log2(block_size) where SLOT_ROWS
    has_kv_start,  # 0 or 1 (an int: Triton 3.6's interpreter takes no bool argument)
    BLOCK_G: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    IDS_AHEAD: tl.constexpr,  # read each tile's block ids one tile ahead (launch_config.ids_ahead)
    SLOT_ROWS: tl.constexpr,  # a block's slots are consecutive cache rows, a power of two of them (`slot_rows`)
):
    # grid: (B, num_kv_heads * group_tiles, num_splits); a program serves BLOCK_G q heads of one kv head.
    seq_idx = tl.program_id(0)
    group_tiles = tl.cdiv(group, BLOCK_G)
    # int64: in a head-major pool the head stride is num_blocks * block_size * head_dim, and a large pool's element
    # offsets overflow int32 (so do block_id * stride_kb, below).
    kv_head = (tl.program_id(1) // group_tiles).to(tl.int64)
    group_start = (tl.program_id(1) % group_tiles) * BLOCK_G
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Visible key positions: [lo, seq_len), intersected with this split's chunk. The chunks cut the sequence's own
    # visible tiles (from the one holding `lo`) into `num_splits` equal runs of whole tiles, each at least
    # `min_chunk` long: the later splits of a short sequence are empty.
    seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int32)
    lo = tl.maximum(seq_len - sliding_window, 0)
    if has_kv_start:
        lo = tl.maximum(lo, tl.load(kv_start_ptr + seq_idx).to(tl.int32))
    base = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.maximum(tl.cdiv(seq_len - base, num_splits), min_chunk)
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    start = tl.maximum(lo, base + split * chunk)
    end = tl.minimum(seq_len, base + (split + 1) * chunk)

    g = group_start + tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    # q: [BLOCK_G, HEAD_DIM_PAD]; padded rows and columns are zero, so they add nothing to the dot products.
    q = tl.load(
        q_ptr + seq_idx * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros((BLOCK_G, HEAD_DIM_PAD), dtype=tl.float32)
    bt_row = block_tables_ptr + seq_idx * stride_bt

    # NOTE: the first tile contains `start` and every later one starts before `end`, so each tile processed has at
    # least one visible key: m_i is finite after the first iteration and exp2(m_i - m_new) never sees -inf - -inf.
    # An empty range (start >= end: a split past the sequence, or nothing visible) must run no tile at all.
    tile_lo = (start // BLOCK_N) * BLOCK_N
    tile_hi = tl.where(start < end, end, tile_lo)
    if IDS_AHEAD:  # each tile's block ids read one tile ahead (launch_config.ids_ahead)
        pos = tile_lo + tl.arange(0, BLOCK_N)
        ids = tl.load(
            bt_row + block_index(pos, block_size, block_shift, SLOT_ROWS), mask=(pos >= start) & (pos < end), other=0
        )
    for tile_start in range(tile_lo, tile_hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        visible = (pos >= start) & (pos < end)
        if IDS_AHEAD:
            block_ids = pool_block_ids(ids, SLOT_ROWS)
            offsets = block_offset(pos, block_size, SLOT_ROWS)
            ahead = pos + BLOCK_N
            ids = tl.load(bt_row + block_index(ahead, block_size, block_shift, SLOT_ROWS), mask=ahead < end, other=0)
        else:
            block_ids, offsets = tile_slots(bt_row, pos, visible, block_size, block_shift, SLOT_ROWS)
        kv_mask = visible[:, None] & d_mask[None, :]
        # k, v: [BLOCK_N, HEAD_DIM_PAD]
        k = load_kv_tile(
            k_cache_ptr, block_ids, offsets, kv_head, d, kv_mask,
            stride_kb, stride_ks, stride_kh, stride_kd, block_size, SLOT_ROWS,
        )  # fmt: skip
        v = load_kv_tile(
            v_cache_ptr, block_ids, offsets, kv_head, d, kv_mask,
            stride_vb, stride_vs, stride_vh, stride_vd, block_size, SLOT_ROWS,
        )  # fmt: skip

        logits = fp32_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # [BLOCK_G, BLOCK_N] fp32
        if USE_SOFTCAP:
            logits = softcap_logits(logits, softcap)
        logits = tl.where(visible[None, :], logits * LOG2E, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + fp32_dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    # A split (or a sequence) with no visible key has l_i == 0: emit zeros, and lse = -inf so the merge ignores it.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if num_splits == 1:
        out_rows = out_ptr + seq_idx * stride_ob + q_heads[:, None] * stride_oh
        tl.store(out_rows + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        num_q_heads = group * (tl.num_programs(1) // group_tiles)
        row = (seq_idx * num_q_heads + q_heads) * num_splits + split  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * head_dim + d[None, :], o, mask=o_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    partial_out_ptr,  # [B, num_q_heads, num_splits, head_dim] fp32 contiguous
    partial_lse_ptr,  # [B, num_q_heads, num_splits] fp32 contiguous, log2 units
    out_ptr,  # [B, num_q_heads, head_dim]
    stride_ob,
    stride_oh,
    stride_od,
    num_splits,
    head_dim,
    HEAD_DIM_PAD: tl.constexpr,
):
    # grid: (B, num_q_heads); a loop over the splits, so registers do not grow with their number.
    seq_idx = tl.program_id(0)
    q_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    first_row = (seq_idx * tl.num_programs(1) + q_head) * num_splits

    lse_max = tl.load(partial_lse_ptr + first_row)
    for s in range(1, num_splits):
        lse_max = tl.maximum(lse_max, tl.load(partial_lse_ptr + first_row + s))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: weights all 0
    total = lse_max * 0.0
    acc = tl.zeros((HEAD_DIM_PAD,), dtype=tl.float32)
    for s in range(num_splits):
        # each split's output is already normalized by its own softmax sum
        weight = tl.exp2(tl.load(partial_lse_ptr + first_row + s) - lse_max)
        acc += weight * tl.load(partial_out_ptr + (first_row + s) * head_dim + d, mask=d_mask, other=0.0)
        total += weight
    o = acc / tl.where(total > 0.0, total, 1.0)
    out_row = out_ptr + seq_idx * stride_ob + q_head * stride_oh
    tl.store(out_row + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def unused_fp32(device: torch.device) -> torch.Tensor:
    """An empty fp32 tensor on `device`, made once: what a launch passes for a pointer its kernel never reads (the
    decode kernel's partial outputs with one split, the prefill kernel's sinks without any); a fresh one per launch is
    an allocation every layer and step."""
    return torch.empty(0, dtype=torch.float32, device=device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property lookup is slow); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # what choose_num_splits returns


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device, block_n: int = 128) -> int:
    """How many chunks to cut each sequence into so that the grid fills the GPU: a power of two up to 64.

    Splitting costs one partial write and a merge, so split only when batch * num_kv_heads programs leave SMs idle,
    and into no more chunks of >= `min_split_tokens(block_n)` tokens (4 K/V tiles of the launch's `block_n`) than the
    block table's width holds, so each program still streams a run of K/V (the kernel cuts each row's chunks from its
    own length, none shorter than that). The count is a runtime argument of both kernels: a new count compiles
    nothing.
    """
    num_programs = batch * num_kv_heads
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    chunk = min_split_tokens(block_n)
    wanted = max(1, min(launch_config.ceil_div(2 * num_sms, num_programs), max_context // chunk, SPLIT_COUNTS[-1]))
    return 1 << (wanted.bit_length() - 1)


def min_split_tokens(block_n: int) -> int:
    """The shortest chunk a split leaves a program: 4 tiles, and at least 128 tokens. A program walks its tiles one
    after the other, about 1.3-1.8 us each on an H200 at 1-8 rows (bench/logs/gpu-h200: one split of 512 tokens in
    16 tiles of 32 at head_dim 256 took 29 us where SDPA took 17), so short contexts need more splits of narrow
    tiles; with the 128-token tiles of head_dim 64 and 128, 512 tokens."""
    return max(128, 4 * block_n)


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
    count and the block table width (never from `seq_lens`, which would need a device sync). The kernel cuts each
    sequence's visible keys into that many equal runs of whole tiles, reading `seq_lens` on the device; with `None`
    no run is shorter than `min_split_tokens`, with a count given none is shorter than one tile.
    """
    launch = DecodeLaunch(
        query, key_cache, value_cache, block_tables, seq_lens, kv_start=kv_start, num_splits=num_splits
    )
    return launch(query, key_cache, value_cache, scale=scale, sliding_window=sliding_window, softcap=softcap, out=out)


class DecodeLaunch:
    """The decode kernel's launch for one step's rows, made once and called for each layer that reads them.

    What a launch is chosen from is the same at every layer of a step's layer group: the rows' block tables, lengths
    and first keys, the query's shape and the pool's layout; so the checks, the tile configuration, the split count,
    the grid and the split-K workspace are made here, and a layer pays its launches and its output only
    (`paged_decode_attention_triton` makes one per call). The workspace is reused by every layer: the layers' launches
    follow each other on one stream, each merge reading it before the next layer's kernel writes it.

    Args:
        query, key_cache, value_cache, block_tables, seq_lens, kv_start: as `paged_decode_attention_triton` takes
            them (the query and caches of any of the layers: each call passes its own, of the same shapes).
        num_splits (`int`, *optional*): as there.
    """

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        kv_start: torch.Tensor | None = None,
        num_splits: int | None = None,
    ):
        check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
        batch, num_q_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        device = query.device
        self.query_shape, self.cache_shape, self.dtype = query.shape, key_cache.shape, query.dtype
        self.kv_start = kv_start
        # A launch on the tensors' device, where that is not the current one (`cuda:1` from a process on `cuda:0`).
        self.device_index = device.index if device.type == "cuda" else None
        self.num_rows, self.num_keys = batch, block_tables.shape[1]
        if not batch or not self.num_keys:
            return
        config = launch_config.decode_config(head_dim, key_cache.dtype, launch_config.device_capability(device))
        group = num_q_heads // num_kv_heads
        group_tiles = launch_config.ceil_div(group, config.block_g)
        max_context = block_tables.shape[1] * block_size
        if num_splits is None:
            num_splits = choose_num_splits(batch, num_kv_heads, max_context, device, config.block_n)
            min_chunk = min_split_tokens(config.block_n)
        else:  # a count asked for: as many chunks as the rows' tiles allow
            min_chunk = config.block_n
        # Each row's chunks are cut on the device from its own length; a split past a short row's keys is empty
        # (it writes lse = -inf, which the merge ignores).
        self.num_splits = num_splits
        self.grid = (batch, num_kv_heads * group_tiles, num_splits)
        self.merge_grid = (batch, num_q_heads, 1)
        if num_splits > 1:
            self.partial_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
            self.partial_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
        else:  # unused by the kernel with one split; fp32 like the real ones, so that both share one compiled variant
            self.partial_out = self.partial_lse = unused_fp32(device)
        self.tables = (block_tables, seq_lens, kv_start if kv_start is not None else seq_lens)  # unused if no kv_start
        self.stride_bt = block_tables.stride(0)
        self.sizes = (min_chunk, group, head_dim, block_size, block_shift(block_size), int(kv_start is not None))
        self.slot_strides = (key_cache.stride(), value_cache.stride())
        self.slot_rows = slot_rows(self.cache_shape, *self.slot_strides)
        self.config = config
        self.options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        self.merge_options = {"num_warps": launch_config.merge_num_warps(head_dim)}
        # The device, and what Triton specializes among the arguments that are the same at every layer (direct.py):
        # with the per-call ones, the key of the compiled variant a layer's launch takes (the merge's holds more
        # than it reads, which only makes it finer).
        fixed = (
            self.device_index,
            pointer_keys(*self.tables, self.partial_out, self.partial_lse),
            int_keys(self.stride_bt, *self.sizes, num_splits),
        )
        self.ids_ahead = launch_config.ids_ahead(config.num_stages)
        self.decode_key = (fixed, config, self.ids_ahead)
        self.merge_key = (fixed, config, self.merge_options["num_warps"])

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query `[B, num_q_heads, head_dim]`, caches `[num_blocks, block_size, num_kv_heads, head_dim]` (of the
        shapes the launch was made for) -> `[B, num_q_heads, head_dim]` (`out`, when given)."""
        if query.shape != self.query_shape or key_cache.shape != self.cache_shape or query.dtype != self.dtype:
            raise ValueError(
                f"this decode launch was made for query {tuple(self.query_shape)} {self.dtype} and caches "
                f"{tuple(self.cache_shape)}, got {tuple(query.shape)} {query.dtype} and {tuple(key_cache.shape)}"
            )
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if not self.num_rows:
            return out
        if not self.num_keys:  # no sequence holds a key: zeros, as the reference gives
            return out.zero_()
        window = clamp_window(sliding_window)
        if self.device_index is not None and self.device_index != torch.cuda.current_device():
            with torch.cuda.device(self.device_index):
                self._launch(query, key_cache, value_cache, out, float(scale), softcap, window)
        else:
            self._launch(query, key_cache, value_cache, out, float(scale), softcap, window)
        return out

    def _launch(self, query, key_cache, value_cache, out, scale: float, softcap: float | None, window: int) -> None:
        config = self.config
        use_softcap = softcap is not None
        q_strides, k_strides, v_strides, out_strides = (
            query.stride(),
            key_cache.stride(),
            value_cache.stride(),
            out.stride(),
        )
        # Slot addressing, as worked out for the caches the launch was made with (every layer's in a pool of one
        # layout): checked inline, no call a layer.
        if k_strides == self.slot_strides[0] and v_strides == self.slot_strides[1]:
            slots = self.slot_rows
        else:
            slots = slot_rows(self.cache_shape, k_strides, v_strides)
        # The per-call part of the variant's key (direct.py's `pointer_keys` of each tensor, written inline: this
        # runs at every layer).
        key = (
            self.decode_key,
            slots,
            use_softcap,
            query.dtype,
            key_cache.dtype,
            value_cache.dtype,
            out.dtype,
            query.data_ptr() % 16 == 0,
            key_cache.data_ptr() % 16 == 0,
            value_cache.data_ptr() % 16 == 0,
            out.data_ptr() % 16 == 0,
            q_strides,
            k_strides,
            v_strides,
            out_strides,
        )
        args = (
            query,
            key_cache,
            value_cache,
            *self.tables,
            out,
            self.partial_out,
            self.partial_lse,
            *q_strides,
            *k_strides,
            *v_strides,
            self.stride_bt,
            *out_strides,
            scale,
            float(softcap) if use_softcap else 1.0,
            window,
            *self.sizes,
            config.block_g,
            config.head_dim_pad,
            config.block_n,
            use_softcap,
            config.dot_precision,
            config.dot_upcast,
            self.ids_ahead,
            slots,
        )
        _DECODE.launch(self.grid, key, args, self.options)
        if self.num_splits > 1:
            merge_args = (
                self.partial_out,
                self.partial_lse,
                out,
                *out_strides,
                self.num_splits,
                self.sizes[2],  # head_dim
                config.head_dim_pad,
            )
            merge_key = (self.merge_key, out.dtype, out.data_ptr() % 16 == 0, out_strides)
            _MERGE.launch(self.merge_grid, merge_key, merge_args, self.merge_options)


# The kernels' launches by the variant a launch's key names (direct.py: without JITFunction.run's binding per call).
_DECODE = DirectKernel(_paged_decode_kernel)
_MERGE = DirectKernel(_merge_splits_kernel)


def block_shift(block_size: int) -> int:
    """log2 of a power-of-two block size (what `block_index` shifts by); 0 for another size, where it is unused."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else 0


def slot_rows(cache_shape: torch.Size, k_strides: tuple, v_strides: tuple) -> bool:
    """Whether the kernels address the caches (`[num_blocks, block_size, kv_heads, head_dim]`, of these strides) by
    slot (`SLOT_ROWS`, see `load_kv_tile`): the block size a power of two, each block's slots consecutive rows of K
    and of V (a pool's head-major and block-major layouts both are), and the pool's slots under 2**31."""
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    return (
        block_size & (block_size - 1) == 0
        and num_blocks * block_size < 1 << 31
        and k_strides[0] == block_size * k_strides[1]
        and v_strides[0] == block_size * v_strides[1]
    )


def clamp_window(sliding_window: int | None) -> int:
    """The kernels' `sliding_window` argument: NO_WINDOW without a window; a window is kept within +-NO_WINDOW, which
    changes no visible key (wider than any sequence; at or below 0 none is visible) and keeps the argument an i32
    for Triton, whatever the caller passes."""
    if sliding_window is None:
        return NO_WINDOW
    return max(-NO_WINDOW, min(int(sliding_window), NO_WINDOW))


def on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (`cuda:1` from a process on `cuda:0`) for the
    launch, where it is another (switching costs each launch a few microseconds)."""
    device = tensor.device
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
