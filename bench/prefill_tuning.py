"""`python -m bench.prefill_tuning`: the paged prefill kernel's launch choices tried on the GPU, beside the ones
`launch_config.prefill_config` makes, and that choice with its query tiles in the grid's ascending order (labelled
"ascending"; the default starts the tiles that attend the most keys first).

For each `--head-dims` (bf16, 32 q / 8 kv heads, block size 16, K/V stored head-major as a `BlockPool` stores them,
scattered block tables), every (BLOCK_M, BLOCK_N, num_warps, num_stages) of the grid below is timed on each cell
(batch x new tokens after cached ones), replayed from a CUDA graph, its output checked against SDPA's on
contiguous K/V. The report has
`bench.decode_tuning`'s form: per cell the default configuration's time, the best one's and what it is, and the
configuration best over all cells. A configuration that spills registers is one CI refuses
(tests/test_kernel_compile.py): check a new choice there before taking it.

    python -m bench.prefill_tuning --json bench/results/gpu/prefill_tuning.json
    TRITON_INTERPRET=1 python -m bench.prefill_tuning --device cpu --tiny      # a dry run in Triton's interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode_tuning  # noqa: E402
from bench.decode_attention import DTYPES  # noqa: E402
from bench.decode_tuning import MAX_TILE_ELEMENTS, add_grid_arguments, make_tiny, run  # noqa: E402
from hf_paged import BlockPool  # noqa: E402
from hf_paged.attention.kernels import launch_config  # noqa: E402

# The grid a lent GPU's step has time for (each configuration compiles at its first launch, seconds on the GPU
# machine's CPU), and a fourth stage only adds shared memory to a loop bound by its gathers. K/V tiles of 128 keys
# are tried up to 64 wide (`WIDEST_KV_TILE`): on sm_90 (statically, `triton.compile` for the target) 128 rows over
# 8 warps take 233-248 registers a thread at head_dim 64 without spills, where at 128 wide every warps and stages
# spill.
BLOCK_MS = (64, 128)
BLOCK_NS = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)
WIDEST_KV_TILE = 128 * 64  # keys x tile width


def candidates(
    default: launch_config.PrefillConfig,
    block_ms=BLOCK_MS,
    block_ns=BLOCK_NS,
    num_warps=NUM_WARPS,
    num_stages=NUM_STAGES,
) -> list[launch_config.PrefillConfig]:
    """`default`, then every tile, warps and stages of the grid whose per-thread share of the query tile (and of the
    fp32 accumulator of the same shape) and of one K or V tile stays bounded, K/V tiles up to `WIDEST_KV_TILE`."""
    configs = []
    for block_m, block_n, warps, stages in itertools.product(block_ms, block_ns, num_warps, num_stages):
        threads = 32 * warps
        if max(block_m, block_n) * default.head_dim_pad // threads > MAX_TILE_ELEMENTS or block_m < default.heads:
            continue
        if block_n * default.head_dim_pad > WIDEST_KV_TILE:
            continue
        configs.append(
            dataclasses.replace(
                default,
                block_m=block_m,
                block_q=block_m // default.heads,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
            )
        )
    # The default's tiles in the grid's ascending order: what the heavy-first order saves.
    ascending = dataclasses.replace(default, heavy_first=not default.heavy_first)
    return [default, ascending, *(config for config in configs if config not in (default, ascending))]


def launched_with(config: launch_config.PrefillConfig):
    """The prefill launcher takes `config` whatever the shapes, while inside."""
    return decode_tuning.launched_with(config, "prefill_config")


def _label(config: launch_config.PrefillConfig) -> str:
    order = "" if config.heavy_first else " ascending"
    return f"M{config.block_m} N{config.block_n} w{config.num_warps} s{config.num_stages}{order}"


def prefill_inputs(args, batch: int, new: int, cached: int, head_dim: int, device: torch.device):
    """(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens) for `batch` sequences of `new` tokens
    after `cached` ones; the pool head-major as a `BlockPool` stores it, the block tables a random permutation."""
    dtype = DTYPES[args.dtype]
    seq_len = cached + new
    blocks_per_seq = -(-seq_len // args.block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.num_kv_heads, num_blocks, args.block_size, head_dim)
    key_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    value_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    block_tables = (
        torch.randperm(num_blocks, generator=gen, device=device)
        .view(batch, blocks_per_seq)
        .to(launch_config.INDEX_DTYPE)
    )
    seq_lens = torch.full((batch,), seq_len, dtype=launch_config.INDEX_DTYPE, device=device)
    cu_seqlens_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    query = torch.randn(batch * new, args.num_q_heads, head_dim, generator=gen, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens


def sdpa_prefill(query, key_cache, value_cache, block_tables, batch: int, new: int, seq_len: int, scale: float):
    """SDPA over the same K/V made contiguous, causal from the bottom right: the expected output, packed."""
    block_size = key_cache.shape[1]
    positions = torch.arange(seq_len, device=query.device)
    ids = block_tables[:, positions // block_size].long()
    key = key_cache[ids, positions % block_size].transpose(1, 2)
    value = value_cache[ids, positions % block_size].transpose(1, 2)
    q = query.view(batch, new, *query.shape[1:]).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), key.float(), value.float(), attn_mask=causal_lower_right(new, seq_len), scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(query.shape)


def tune_cell(args, head_dim: int, configs: list, cell: tuple[int, int, int], device: torch.device) -> dict:
    """{configuration: ms per call, or why it has no time} for one (batch, new, cached) cell."""
    from hf_paged.attention.kernels.triton_prefill import paged_prefill_attention_triton

    batch, new, cached = cell
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens = prefill_inputs(
        args, batch, new, cached, head_dim, device
    )
    scale, out = head_dim**-0.5, torch.empty_like(query)
    expected = sdpa_prefill(query, key_cache, value_cache, block_tables, batch, new, cached + new, scale)

    def paged():
        paged_prefill_attention_triton(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale, out=out
        )

    return decode_tuning.time_configs(args, configs, paged, out, expected, device, _label, "prefill_config")


def tune_head_dim(args, head_dim: int, device: torch.device, save=lambda result: None) -> dict:
    """Every candidate configuration of `head_dim` on every cell; `save` is called after every cell."""
    group = args.num_q_heads // args.num_kv_heads
    capability = launch_config.device_capability(device)
    default = launch_config.prefill_config(head_dim, group, DTYPES[args.dtype], capability)
    configs = candidates(default, args.block_ms, args.block_ns, args.num_warps, args.num_stages)
    cells = []
    result = dict(head_dim=head_dim, default=_label(default), cells=cells)
    for cell in args.cells:
        times = tune_cell(args, head_dim, configs, cell, device)
        # `context` is the column bench.decode_tuning.table shows: here new tokens + cached ones
        cells.append(dict(batch=cell[0], context=f"{cell[1]}+{cell[2]}", times=times))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(result)
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_tuning", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--cells", nargs="+", default=["1:2048:0", "1:8192:0", "8:512:4096"], help="BATCH:NEW:CACHED")
    parser.add_argument("--block-ms", type=int, nargs="+", default=list(BLOCK_MS))
    add_grid_arguments(parser, BLOCK_NS, rep_ms=20.0, tolerance=3e-2, num_stages=NUM_STAGES)
    parser.add_argument("--tiny", action="store_true", help="head_dim 32, 2 small cells, 4/2 heads, fp32, 2 configs")
    args = parser.parse_args(argv)
    if args.tiny:
        make_tiny(args, ["1:24:0", "2:8:20"])
        args.block_ms, args.block_ns = [16], [16]
    args.cells = [tuple(int(n) for n in cell.split(":")) for cell in args.cells]
    return args


def main(argv=None) -> int:
    return run(parse_args(argv), tune_head_dim, "bench.prefill_tuning", "new+cached")


if __name__ == "__main__":
    raise SystemExit(main())
