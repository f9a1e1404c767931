"""Launch choices of the Triton kernels (tile sizes, warps, pipeline stages) as plain functions of the shapes and
the GPU's compute capability.

The launchers call these with `device_capability(device)`; `resources.py` calls the launchers with it answering
sm_80 or sm_90 on a machine without either GPU, which is how CI checks that every variant a launcher can pick
compiles without register spills (docs/kernels.md lists each variant's registers and occupancy).

Why the choices, for a memory-bound kernel that should never spill (a decode program holds, per thread, its share
of a `[BLOCK_G, head_dim_pad]` fp32 accumulator, the query tile, the `[BLOCK_G, BLOCK_N]` logits, and one
`[BLOCK_N, head_dim_pad]` tile each of K and V, plus the next tiles' loads in flight):
- `BLOCK_G` is 16 whatever the GQA group: `tl.dot` needs 16 rows; a larger group runs one program per 16 q heads
  (neighbours in the grid, so the second one's K/V reads mostly hit L2);
- each thread's share of a K or V tile is a fixed 16 registers: wide heads take fewer tokens per tile (and 8
  warps from 128 wide) instead of more registers per thread, and an fp32 cache, whose dot products run on CUDA
  cores in full precision, takes half the tokens of a 16-bit one;
- narrow heads stop at 64 tokens and at twice the tile width: past that a tile adds more logits than K/V;
- 2 pipeline stages: the next tile's loads are in flight while one is used;
- except where measured better: 16-bit caches at head_dim 64, 128 and 256 take the tiles, warps and stages of
  `TUNED_DECODE` (`python -m bench.decode_tuning` on an H200, bench/logs/gpu-h200/REPORT.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Compute capabilities that CI compiles every kernel variant for (docs/kernels.md): A100, H100/H200.
CHECKED_CAPABILITIES = (80, 90)
# The dtype of the block tables, sequence lengths and first keys (`kv_start`) every caller hands the kernels
# (PagedCache eager and compiled, the Engine's packed step and decode runner; `cu_seqlens_q` is int32): a pointer's
# dtype is part of a compiled variant, so one dtype is one variant per launch configuration, the one CI compiles
# (resources.py; tests/test_launch_variants.py records what the callers launch).
INDEX_DTYPE = torch.int64
TILE_REGISTERS = 16  # per thread, for its share of one [BLOCK_N, head_dim_pad] K or V tile
# Narrow heads: past these, a longer tile adds more logits ([BLOCK_G, BLOCK_N] fp32) than K/V per thread.
MAX_BLOCK_N = 64
# 16-bit caches, tile width -> (BLOCK_N, warps, stages): the fastest over batch x context 8 x 512, 8 x 8192 and
# 32 x 8192 of `python -m bench.decode_tuning` (bf16, 32 q / 8 kv heads, block size 16) on an NVIDIA H200, triton
# 3.6, against the register rule's N64 w4 s2 / N64 w8 s2 / N32 w8 s2 (us at those three cells):
#   64:  N128 w8 s3   8.6 / 46.7 / 158.2   against 11.3 / 63.7 / 227.9 (1.32-1.44x): longer tiles, more loads in flight
#   128: N128 w8 s2  13.1 / 75.6 / 268.0   against 14.7 / 88.8 / 325.3 (1.13-1.21x)
#   256: N32 w4 s3   31.3 / 152.7 / 568.7  against 29.5 / 186.1 / 702.1 (0.94x at 8 x 512, 1.22-1.23x at 8k)
# Each keeps a thread's share of a K or V tile at <= 64 elements and compiles without spills for sm_80 and sm_90.
# Those times were taken with the block ids read within each tile; the 3-stage ones now read them a tile ahead
# (`ids_ahead`), not yet timed on a GPU.
TUNED_DECODE = {64: (128, 8, 3), 128: (128, 8, 2), 256: (32, 4, 3)}


@dataclass(frozen=True)
class DecodeConfig:
    """How `_paged_decode_kernel` is launched for one (head_dim, dtype, GPU)."""

    head_dim_pad: int  # head_dim rounded up to a power of two >= 16 (tl.arange and tl.dot sizes)
    block_g: int  # q heads per program
    block_n: int  # tokens per K/V tile
    num_warps: int
    num_stages: int
    dot_precision: str  # "ieee" for fp32 caches (no tf32 rounding), "tf32" (ignored for 16-bit inputs) otherwise
    dot_upcast: bool  # widen bf16 dot inputs to fp32: only in Triton's CPU interpreter (see triton_decode.fp32_dot)


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` of two ints, on the host. Why not `triton.cdiv`: called from Python it is a Triton constexpr
    function, about 1.3-1.9 us a call, and a launcher asks it several times at every launch."""
    return -(-a // b)


def head_dim_pad(head_dim: int) -> int:
    """The power-of-two tile width for `head_dim` (>= 16: the smallest `tl.dot` dimension)."""
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.cache
def device_capability(device: torch.device) -> int | None:
    """The compute capability of a CUDA device as one int (80: sm_80, 90: sm_90), None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.cache  # asked at every launch, of a few (head_dim, dtype, GPU) per process
def decode_config(head_dim: int, dtype: torch.dtype, capability: int | None) -> DecodeConfig:
    """The decode kernel's launch for K/V of `head_dim` in `dtype` on a GPU of `capability` (None: interpreter).

    The choice depends on the tile width (`head_dim_pad`), the element size and capability only, so each
    (dtype, tile width) compiles one variant per GPU.
    """
    pad = head_dim_pad(head_dim)
    num_warps = 4 if pad <= 64 else 8
    # Each thread holds TILE_REGISTERS registers of a K (or V) tile: 32 elements of a 16-bit cache, 16 of fp32.
    elements_per_thread = TILE_REGISTERS * 4 // dtype.itemsize
    block_n = min(MAX_BLOCK_N, 2 * pad, elements_per_thread * 32 * num_warps // pad)
    # One stage for fp32 caches at 128 wide on sm_90: with two, Triton 3.6's ptxas spills a register there.
    num_stages = 1 if dtype == torch.float32 and pad == 128 and capability is not None and capability >= 90 else 2
    # Measured on sm_90; sm_80 and later hold their shared memory (72 KiB at 128 wide), sm_75 (64 KiB) does not.
    if dtype.itemsize == 2 and pad in TUNED_DECODE and (capability is None or capability >= 80):
        block_n, num_warps, num_stages = TUNED_DECODE[pad]
    return DecodeConfig(
        head_dim_pad=pad,
        block_g=16,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        dot_precision="ieee" if dtype == torch.float32 else "tf32",
        dot_upcast=dtype == torch.bfloat16 and capability is None,
    )


@dataclass(frozen=True)
class PrefillConfig:
    """How `_paged_prefill_kernel` is launched for one (head_dim, GQA group, dtype, GPU)."""

    head_dim_pad: int
    block_m: int  # query rows per program: block_q tokens x heads q heads
    heads: int  # q heads of one kv head per program (a power of two up to 16)
    block_q: int  # new tokens per program
    block_n: int  # keys per K/V tile
    num_warps: int
    num_stages: int
    dot_precision: str
    dot_upcast: bool
    # Read the tiles every row sees whole (keys up to the first query's own position, inside every row's window)
    # without a mask, in a loop of their own before the masked one. It saves the mask's work on most tiles of a long
    # prompt and costs registers, fewer programs an SM at some head dims (docs/kernels.md): 1.3-1.8x faster on an
    # H200 in bf16 at every shape `bench/prefill_attention.py` times (head_dim 64 and 128, 2k-8k-token prompts and
    # chunks after 2k-4k cached tokens; bench/logs/gpu-h200-5554460), so on for 16-bit caches of those head sizes,
    # whose programs an SM it leaves as they were on sm_80 and sm_90 (fp16 has bf16's registers). The other head
    # sizes keep one masked loop until measured (at 16 and 32 it costs a program an SM on sm_80). Never for fp32
    # caches: their 128-wide variant spills on sm_90 with the second loop.
    unmasked_tiles: bool = False
    # The grid's query tiles in reverse, the kv heads of a tile neighbours: in a causal prefill a sequence's last tile
    # attends every key and its first almost none, so a sequence's longest programs start before its shorter ones,
    # which fill the last wave, instead of the longest starting last and running alone (FlashAttention's order for a
    # causal grid). Several sequences run last one first. `python -m bench.prefill_tuning` times the ascending order.
    heavy_first: bool = True


# Query rows per prefill program (tokens x q heads): a tile of 64 rows against a K/V tile keeps the fp32
# accumulator, the query tile and one K and one V tile in registers at every head width (8 warps from 128 wide).
PREFILL_BLOCK_M = 64
# 16-bit caches on sm_90 (Hopper) only: (tile width, softcap) -> (query rows, warps, stages). Hopper's `wgmma` gives
# each warpgroup (4 warps) 64 rows. With 64 rows and 8 warps, Triton lays the QK^T product out as [8, 1] warps over
# 64 rows: both warpgroups compute the same logits, and the PV product, laid out [4, 2], takes a layout conversion
# through shared memory every tile (the sm_90 SASS at head_dim 128: 40 `HGMMA` a program against 24 with 128 rows,
# for half the rows). So 128 rows a program, with the warps and stages `python -m bench.prefill_tuning` timed on an
# H200 (bf16, 32 q / 8 kv heads; a 2k and an 8k prompt and 8 chunks of 512 after 4k cached; bench/logs/
# gpu-h200-9849b1a), the fastest that compiles without spills:
# - 64 wide: 128 rows over one warpgroup (4 warps): 1.12x, 1.23x and 1.47x the 128 rows over 8 warps at 2k, 8k and
#   512+4k with 2 stages, 1.15x, 1.32x and 1.62x with 3; each K/V tile in shared memory serves 128 rows. The softcap's
#   variant spills over one warpgroup: it keeps 8 warps.
# - 128 wide: 128 rows over 8 warps (64 a warpgroup), 3 stages: 1.01-1.05x two stages, 1.08-1.13x 64 rows over 4.
# 3 stages everywhere, with each tile's block ids read a tile ahead (`ids_ahead`): the sm_90 TTGIR of the loop without
# a mask then waits with the next tile's K and V in flight (`ttg.async_wait {num = 2}`); with 2 stages it waits for
# every copy (`num = 0`) at the top of each tile, the next tile's loads issued only after the tile's softmax, so that
# their latency is paid in full each tile. Those 3-stage times were taken with the ids read within the tile (3 stages
# then spilled at 64 wide: 255 registers and a stack frame); with them read ahead, the 64-wide variants compile to
# 255 / 204 registers (softcap) on Triton 3.6 and 254 / 200 on Triton 3.9, without spills.
# tests/test_kernel_compile.py checks every one for spills; registers are in docs/kernels.md. sm_80 keeps 64 rows
# (the 128-wide variant spills there with 128); so do later GPUs until measured (sm_120's dots are sm_80's).
PREFILL_SM90 = {
    (64, False): (128, 4, 3),
    (64, True): (128, 8, 3),
    (128, False): (128, 8, 3),
    (128, True): (128, 8, 3),
}


@functools.cache  # asked at every launch, of a few (head_dim, group, dtype, GPU) per process
def prefill_config(
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    capability: int | None,
    softcap: bool = False,
    slot_rows: bool = True,
) -> PrefillConfig:
    """The prefill kernel's launch for K/V of `head_dim` in `dtype`, `group` q heads per kv head, on a GPU of
    `capability` (None: interpreter), for the kernel with a logit softcap when `softcap`, for a pool whose blocks
    are a power of two of consecutive cache rows when `slot_rows` (`triton_decode.slot_rows`; else the general
    addressing, whose 64-wide sm_90 variant takes the softcap's 8 warps: over one warpgroup Triton 3.6 spills it).

    Why: a program's rows are `block_q` tokens x `heads` q heads, so a K/V tile read from the pool serves the whole
    GQA group (up to 16 heads; a larger group takes one program per 16, neighbours in the grid; both are runtime
    arguments, so one variant serves every group); 64 rows (128 for 16-bit caches at head_dim 64 and 128 on sm_90,
    with the warps and stages measured there: `PREFILL_SM90`), K/V tiles of 64 keys (32 at head_dim 256), 4 warps to 64
    wide and 8 from 128 (an fp32 cache, whose dots run on CUDA cores: 32 rows, 16 keys, 8 warps from 256, one
    stage to 32 wide and at 64 wide on sm_90), 2 stages (one at 16 wide):
    per thread, the accumulator, the query and one K and one V tile stay under the register file's share without
    spills (tests/test_kernel_compile.py); 16-bit caches of head_dim 64 and 128 read the tiles every row sees whole
    without a mask (`unmasked_tiles`).
    """
    pad = head_dim_pad(head_dim)
    heads = min(16, 1 << (max(group, 1) - 1).bit_length())
    block_m, block_n, num_warps, num_stages = PREFILL_BLOCK_M, 64 if pad <= 128 else 32, 4 if pad <= 64 else 8, 2
    if dtype.itemsize == 2 and (pad, softcap) in PREFILL_SM90 and capability == 90:
        block_m, num_warps, num_stages = PREFILL_SM90[pad, softcap or (pad == 64 and not slot_rows)]
    if dtype == torch.float32:  # CUDA-core dots hold whole operand rows per thread: half the rows, 16 keys
        block_m, block_n, num_warps = PREFILL_BLOCK_M // 2, 16, 4 if pad <= 128 else 8
        # One stage to 32 wide, and at 64 wide on sm_90: with two, Triton 3.6's ptxas spills a register (an 8-byte
        # stack frame) in the softcap's 32-wide variant on sm_80 and in the 64-wide variant on sm_90.
        sm90 = capability is not None and capability >= 90
        num_stages = 1 if pad <= 32 or (pad == 64 and sm90) else 2
    if pad == 16:
        # One stage at 16 wide, whatever the dtype: with two, Triton 3.9 leaves an 8-byte stack frame in the softcap's
        # variants on sm_80 (a size of test models; a tile of 16 keys x 16 dims has little to keep in flight).
        num_stages = 1
    return PrefillConfig(
        head_dim_pad=pad,
        block_m=block_m,
        heads=heads,
        block_q=block_m // heads,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        dot_precision="ieee" if dtype == torch.float32 else "tf32",
        dot_upcast=dtype == torch.bfloat16 and capability is None,
        unmasked_tiles=dtype != torch.float32 and pad in (64, 128),
    )


def ids_ahead(num_stages: int) -> bool:
    """Whether a decode or prefill launch of `num_stages` pipeline stages reads each K/V tile's block ids from the block
    table one tile ahead (carried in registers) rather than within the tile.

    Why: Triton's pipeliner gives an indirect load (K/V addresses from a block-table load in the same iteration) one
    stage of its own, so with 3 stages it kept one tile's K/V in flight, as with 2 (the sm_90 TTGIR waits with
    `ttg.async_wait {num = 0}` at the top of the loop); with the ids read a tile ahead, the K/V loads are direct and
    two tiles are in flight (`num = 2`). With 2 stages there is no such stage to win back, and the ids carried cost
    registers (sm_80's 128-wide bf16 decode variant: 97 -> 154, one program an SM fewer), so they stay in the tile.
    """
    return num_stages >= 3


def merge_num_warps(head_dim: int) -> int:
    """Warps of the split-K merge kernel: one fp32 `head_dim` row per program, two elements or more per thread."""
    return 1 if head_dim_pad(head_dim) <= 64 else 2


def store_num_warps(head_dim: int) -> int:
    """Warps of the store kernel: one K and one V row per program, a 16-byte vector per thread for 16-bit rows."""
    return 1 if head_dim_pad(head_dim) <= 128 else 2
