"""Prefill (extend) attention over a paged KV pool: the Triton kernel vs. SDPA on contiguous K/V, in TFLOP/s.

For every (batch, new tokens, cached tokens) cell, each of `batch` sequences adds `new` tokens after `cached` ones
and attends causally over all of them:
  (a) paged:        `hf_paged.attention.kernels.paged_prefill_attention`, the sequences packed (`cu_seqlens_q`),
                    K/V read from the block pool through scattered block tables (stored head-major, as a
                    `BlockPool` stores them);
      with the Triton backend in 16 bits, again with `unmasked_tiles` turned the other way (launch_config: the tiles
      every row of a program sees whole read without a mask, on by default for 16-bit caches): "masked tiles only";
  (b) sdpa-contig:  `torch.nn.functional.scaled_dot_product_attention` per batch on contiguous K/V with the
                    lower-right causal bias (flash or memory-efficient kernels on CUDA): what a non-paged cache does.
GQA runs through SDPA with `enable_gqa`. FLOPs count the causal half of QK^T and PV, `4 * heads * head_dim * new *
(cached + (new + 1) / 2)` per sequence, the same for both columns; timing is `triton.testing.do_bench` (median).

    python -m bench.prefill_attention                          # default grid, bf16, on the GPU
    python -m bench.prefill_attention --json bench/results/prefill.json
    python -m bench.prefill_attention --device cpu --tiny      # seconds-long smoke run on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch
from tabulate import tabulate
from torch.nn.attention.bias import causal_lower_right

from bench.decode_attention import DTYPES, fits_in_memory, peak_of, time_ms, write_report
from bench.decode_tuning import launched_with
from hf_paged import BlockPool
from hf_paged.attention.kernels import launch_config, paged_prefill_attention, resolve_backend

# (batch, new tokens, cached tokens): whole prompts of 2k-8k tokens, and chunks over a cached prefix
DEFAULT_CELLS = [(1, 2048, 0), (1, 4096, 0), (1, 8192, 0), (4, 2048, 0), (8, 512, 4096), (16, 256, 2048)]
# Dense fp16/bf16 tensor-core peak in FLOP/s, matched against the device name as in decode_attention.py.
PEAK_FLOPS = [(("H200",), 989e12), (("H100", "PCIe"), 756e12), (("H100",), 989e12), (("A100",), 312e12)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cells", nargs="+", default=None, metavar="B:NEW:CACHED", help="cells (default: 2k-8k prompts, extends)"
    )
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run; combine with --tiny)")
    parser.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto", help="for method (a)")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (2 cells, 4/2 heads, head_dim 32, fp32)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.cells = ["1:48:0", "2:16:40"]
        args.num_q_heads, args.num_kv_heads, args.head_dim, args.dtype = 4, 2, 32, "fp32"
    cells = DEFAULT_CELLS if args.cells is None else [tuple(map(int, cell.split(":"))) for cell in args.cells]
    if any(len(cell) != 3 or cell[0] < 1 or cell[1] < 1 or cell[2] < 0 for cell in cells):
        parser.error(f"--cells takes BATCH:NEW:CACHED with BATCH, NEW >= 1 and CACHED >= 0, got {args.cells}")
    args.cells = cells
    if args.num_q_heads % args.num_kv_heads:
        parser.error(f"--num-q-heads ({args.num_q_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    return args


def bench_cell(args, batch: int, new: int, cached: int, device: torch.device, peak: float | None) -> list[dict]:
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    seq_len = cached + new
    blocks_per_seq = math.ceil(seq_len / args.block_size)
    num_blocks = batch * blocks_per_seq
    kv_bytes = 2 * num_blocks * args.block_size * args.num_kv_heads * args.head_dim * itemsize
    cell = {"batch": batch, "new": new, "cached": cached}
    if not fits_in_memory(int(2.5 * kv_bytes) + (1 << 30), device):
        return [{**cell, "method": "all", "skipped": "does not fit in memory"}]
    gen = torch.Generator(device=device).manual_seed(0)
    # Stored as a BlockPool stores them (head-major: each head's blocks contiguous), handed over as the pool hands
    # them to the kernels (`BlockPool.nhd_view`, `[num_blocks, block_size, num_kv_heads, head_dim]`).
    shape = (args.num_kv_heads, num_blocks, args.block_size, args.head_dim)
    key_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    value_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    block_tables = (
        torch.randperm(num_blocks, generator=gen, device=device)
        .view(batch, blocks_per_seq)
        .to(launch_config.INDEX_DTYPE)
    )
    seq_lens = torch.full((batch,), seq_len, dtype=launch_config.INDEX_DTYPE, device=device)
    cu_seqlens_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    query = torch.randn(batch * new, args.num_q_heads, args.head_dim, generator=gen, dtype=dtype, device=device)
    scale = args.head_dim**-0.5
    out = torch.empty_like(query)

    def paged():
        paged_prefill_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale=scale, out=out,
            backend=args.backend,
        )  # fmt: skip

    flops = batch * 4 * args.num_q_heads * args.head_dim * new * (cached + (new + 1) / 2)
    backend = resolve_backend(args.backend, device)
    rows = [{**cell, "method": f"paged ({backend})", "ms": time_ms(paged, device, args.warmup_ms, args.rep_ms)}]
    outs = [out.float()]
    if backend == "triton":
        config = launch_config.prefill_config(
            args.head_dim, args.num_q_heads // args.num_kv_heads, dtype, launch_config.device_capability(device)
        )
        if dtype != torch.float32:  # the other way of reading the whole tiles (fp32 caches take one loop only)
            other = dataclasses.replace(config, unmasked_tiles=not config.unmasked_tiles)
            with launched_with(other, "prefill_config"):
                ms = time_ms(paged, device, args.warmup_ms, args.rep_ms)
                outs.append(out.float())
            label = "unmasked tiles" if other.unmasked_tiles else "masked tiles only"
            rows.append({**cell, "method": f"paged (triton, {label})", "ms": ms})

    # contiguous K/V [B, Hkv, S, D] and the query [B, Hq, new, D]
    positions = torch.arange(seq_len, device=device)
    ids = block_tables[:, positions // args.block_size].long()
    key = key_cache[ids, positions % args.block_size].transpose(1, 2).contiguous()
    value = value_cache[ids, positions % args.block_size].transpose(1, 2).contiguous()
    key_cache = value_cache = None
    q = query.view(batch, new, args.num_q_heads, args.head_dim).transpose(1, 2)
    bias = causal_lower_right(new, seq_len)

    def sdpa():
        sdpa_attention = torch.nn.functional.scaled_dot_product_attention
        return sdpa_attention(q, key, value, attn_mask=bias, scale=scale, enable_gqa=True)

    rows.append({**cell, "method": "sdpa-contig", "ms": time_ms(sdpa, device, args.warmup_ms, args.rep_ms)})
    expected = sdpa().transpose(1, 2).reshape(batch * new, args.num_q_heads, args.head_dim).float()
    for row in rows:
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        row["peak_fraction"] = flops / (row["ms"] * 1e-3) / peak if peak else None
    for row, paged_out in zip(rows, outs):  # the paged rows, before SDPA's
        row["speed_vs_sdpa"] = rows[-1]["ms"] / row["ms"]
        row["max_abs_err_vs_sdpa"] = (paged_out - expected).abs().max().item()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "CUDA is not available: this benchmark times GPU kernels. "
            "For a smoke run of the script on CPU: python -m bench.prefill_attention --device cpu --tiny"
        )
        return 0
    device_name, peak = peak_of(device, PEAK_FLOPS)
    print(
        f"device: {device_name}; {args.dtype}, {args.num_q_heads} q / {args.num_kv_heads} kv heads, head_dim "
        f"{args.head_dim}, block_size {args.block_size}"
    )
    results = []
    for batch, new, cached in args.cells:
        results.extend(bench_cell(args, batch, new, cached, device, peak))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = [
        [
            r["batch"],
            r["new"],
            r["cached"],
            r["method"],
            r.get("skipped") or f"{r['ms'] * 1e3:.0f}",
            f"{r['tflops']:.1f}" if "ms" in r else "",
            f"{r['peak_fraction']:.0%}" if r.get("peak_fraction") is not None else "",
            f"{r['speed_vs_sdpa']:.2f}x" if "speed_vs_sdpa" in r else "",
            f"{r['max_abs_err_vs_sdpa']:.1e}" if "max_abs_err_vs_sdpa" in r else "",
        ]
        for r in results
    ]
    headers = ["batch", "new", "cached", "method", "time (us)", "TFLOP/s", "% peak", "vs sdpa", "max |err|"]
    print(tabulate(table, headers=headers, disable_numparse=True))
    if args.json:
        write_report(args.json, {"device": device_name, "peak_flops": peak, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
