"""Decode attention over a paged KV pool: the Triton kernel vs. gather + SDPA vs. SDPA on contiguous K/V.

For every (batch, context) cell, one new token per sequence attends to `context` cached tokens:
  (a) paged:         `hf_paged.attention.kernels.paged_decode_attention` reading the block pool through block tables
                     (K/V stored head-major, as a `BlockPool` stores them: each head's blocks contiguous);
  (b) gather+sdpa:   what a `PagedCache` runs under the sdpa attention where a batch's blocks are not one run:
                     the library's gather (`GatherWorkspace`: one `index_select` of whole blocks per K and V into a
                     reused buffer, its index made once as for a step's layers), then
                     `torch.nn.functional.scaled_dot_product_attention`; the gather is inside the timing;
  (c) sdpa-contig:   SDPA on K/V that are already contiguous (what a non-paged cache would do; the bound to beat).
With `--table-tokens N`, (a) also runs with block tables N tokens wide over the same rows (the columns past a row's
blocks point at other blocks), as CUDA graphs' and a `max_cache_len` cache's tables are: as wide as the rows may
grow; split-K's count is then chosen from that width, and each row's chunks from its own length.
GQA runs through SDPA without copying K/V heads: the q heads of one kv head become the query "length" dim.

Bandwidth = bytes that must be read (K and V of every sequence, plus the queries) / time, the same count for all
three methods, so the columns compare directly. Timing: `triton.testing.do_bench` (median, L2 flushed between runs):
each call launched from Python, so a small cell's time is the host's launch when that is longer than the kernel.
On CUDA each method is also timed replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`, calls unrolled in
one graph, no L2 flush): the device's time alone, as the Engine's replayed decode steps see it.

    python bench/decode_attention.py                                  # default grid, bf16, on the GPU
    python bench/decode_attention.py --batch-sizes 1 8 --context-lens 8192 --json bench/results/decode.json
    python bench/decode_attention.py --batch-sizes 1 8 --context-lens 512 2048 --table-tokens 32768
    python bench/decode_attention.py --device cpu --tiny              # seconds-long smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types

import torch
from tabulate import tabulate

from hf_paged import BlockPool
from hf_paged.attention.kernels import gather_kv, paged_decode_attention, resolve_backend
from hf_paged.attention.kernels.launch_config import INDEX_DTYPE
from hf_paged.cache.block_tables import head_major_index
from hf_paged.cache.gather import GatherWorkspace

# Peak HBM bandwidth in bytes/s, matched against torch.cuda.get_device_name(); the first row whose words all occur
# in the name wins, so the more specific rows come first.
PEAK_BANDWIDTH = [
    (("H200",), 4.8e12),
    (("H100", "PCIe"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),  # SXM (HBM3), reported as "NVIDIA H100 80GB HBM3"
    (("A100", "80GB"), 2.0e12),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run; combine with --tiny)")
    parser.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto", help="for method (a)")
    parser.add_argument("--peak-bandwidth", type=float, help="bytes/s; overrides the table keyed by device name")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--graph-rep-ms", type=float, default=20.0, help="time replayed from a CUDA graph, per method")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="also time (a) with block tables this many tokens wide, at the cells whose context is shorter",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (batch 1 2, context 64 256, 4/2 heads, head_dim 64, fp32)"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch_sizes, args.context_lens = [1, 2], [64, 256]
        args.num_q_heads, args.num_kv_heads, args.head_dim, args.dtype = 4, 2, 64, "fp32"
    if args.num_q_heads % args.num_kv_heads:
        parser.error(f"--num-q-heads ({args.num_q_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    return args


def peak_bandwidth(device: torch.device, override: float | None) -> tuple[str, float | None]:
    """(device name, peak bytes/s or None when unknown)."""
    name, bandwidth = peak_of(device, PEAK_BANDWIDTH)
    return name, override if override is not None else bandwidth


def peak_of(device: torch.device, table: list) -> tuple[str, float | None]:
    """(device name, the value of `table`'s first row whose words all occur in it; None off CUDA or when none)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((value for words, value in table if all(word in name for word in words)), None)


def write_report(path: str, report: dict, quiet: bool = False) -> None:
    """`report` as JSON at `path` (its folder made)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    if not quiet:
        print(f"wrote {path}")


def time_ms(fn, device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call of `fn`."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()  # CPU: warm up once, then time whole calls until rep_ms has passed
    times, deadline = [], time.perf_counter() + rep_ms / 1e3
    while not times or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, device: torch.device, rep_ms: float) -> float | None:
    """Median milliseconds per call of `fn` replayed from a CUDA graph (None off CUDA)."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def fits_in_memory(num_bytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes < 0.9 * free


def sdpa_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, Hq, D], key/value [B, Hkv, S, D] -> [B, Hq, D]. The GQA group rides in SDPA's query-length dim."""
    batch, num_q_heads, head_dim = query.shape
    q = query.view(batch, key.shape[1], num_q_heads // key.shape[1], head_dim)  # [B, Hkv, group, D]
    return torch.nn.functional.scaled_dot_product_attention(q, key, value, scale=scale).reshape(query.shape)


def decode_inputs(args, batch: int, context: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(query `[B, q_heads, head_dim]`, key_cache, value_cache, block_tables `[B, n]`, seq_lens `[B]`) for `batch`
    sequences of `context` cached tokens: `ragged_inputs` with every row as long."""
    return ragged_inputs(args, [context] * batch, head_dim, device)


def parse_cell(text: str) -> tuple[int, int, int]:
    """A cell of ragged rows: "32x128-1280" -> (32, 128, 1280), rows and their shortest and longest length; "8x512"
    -> (8, 512, 512)."""
    batch, lengths = text.split("x")
    lo, _, hi = lengths.partition("-")
    return int(batch), int(lo), int(hi or lo)


def ragged_lengths(batch: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """`batch` lengths uniform in [lo, hi], seeded."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()


def ragged_inputs(args, lengths: list[int], head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(query `[B, q_heads, head_dim]`, key_cache, value_cache, block_tables `[B, n]`, seq_lens `[B]`) for rows of
    `lengths` cached tokens in `args.dtype`, seeded: the tables and lengths in the dtype the library hands the kernels
    (`launch_config.INDEX_DTYPE`); the caches stored as a BlockPool stores them (head-major: each head's blocks
    contiguous) and handed over as the pool hands them to the kernels (`BlockPool.nhd_view`, `[num_blocks,
    block_size, num_kv_heads, head_dim]`), the block tables scattered, as in a pool that has served many requests;
    each table row as wide as the longest, the columns past a row's blocks pointing at other rows' blocks."""
    dtype = DTYPES[args.dtype]
    blocks = [math.ceil(n / args.block_size) for n in lengths]
    num_blocks, width = sum(blocks), max(blocks)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.num_kv_heads, num_blocks, args.block_size, head_dim)
    key_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    value_cache = BlockPool.nhd_view(torch.randn(shape, generator=gen, dtype=dtype, device=device))
    ids = torch.randperm(num_blocks, generator=gen, device=device).to(INDEX_DTYPE)
    query = torch.randn(len(lengths), args.num_q_heads, head_dim, generator=gen, dtype=dtype, device=device)
    tables = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, device=device, dtype=INDEX_DTYPE)
    first = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = ids[first : first + n]
        first += n
    seq_lens = torch.tensor(lengths, dtype=INDEX_DTYPE, device=device)
    return query, key_cache, value_cache, tables, seq_lens


def checked_ms(args, run, out: torch.Tensor, expected: torch.Tensor, device: torch.device) -> float | str:
    """Milliseconds per `run()`, replayed from a CUDA graph where one captures (else timed from Python), once its
    `out` is within `args.tolerance` of `expected`; otherwise why it has no time: "wrong (max |err| ...)" or the
    name of the error its launch or capture raised (a tuning run records it and times the rest)."""
    try:
        run()
        error = float((out.float() - expected).abs().max())
        if error > args.tolerance:
            return f"wrong (max |err| {error:.1e})"
        measured = graph_ms(run, device, args.rep_ms)
        return measured if measured is not None else time_ms(run, device, 1.0, args.rep_ms)
    except Exception as error:  # a configuration the compiler refuses, or one its graph capture does
        return type(error).__name__


class PoolTables:
    """The cell's block tables as the library's gather reads a layer group's (`GatherTables`): one pool layer of
    head-major K/V (`[kv_heads, num_blocks, block_size, head_dim]`, as a `BlockPool` stores them), every row's blocks
    gathered (no row is one consecutive run of blocks, as in a batch)."""

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int):
        # key_cache / value_cache: the `[num_blocks, block_size, kv_heads, head_dim]` views of head-major tensors
        heads_first = [cache.permute(2, 0, 1, 3) for cache in (key_cache, value_cache)]
        assert all(cache.is_contiguous() for cache in heads_first), "a head-major pool tensor"
        self.pool = types.SimpleNamespace(key_cache=heads_first[:1], value_cache=heads_first[1:], block_size=block_size)
        self.num_rows = block_tables.shape[0]
        self.memo: dict = {}
        self._tables = block_tables

    def consecutive_run(self, first_block: int, end_block: int) -> int | None:
        return None

    def gather_index(self, first_block: int, end_block: int, num_heads: int, num_pool_blocks: int) -> torch.Tensor:
        return head_major_index(self._tables[:, first_block:end_block].long(), num_heads, num_pool_blocks)


def widened_tables(block_tables: torch.Tensor, width: int, num_blocks: int) -> torch.Tensor:
    """`block_tables` `[B, n]` widened to `width` columns, the new ones other blocks of the pool (seeded), past every
    row's length as in a table made as wide as its rows may grow."""
    gen = torch.Generator(device=block_tables.device).manual_seed(1)
    extra = torch.randint(
        0, num_blocks, (block_tables.shape[0], width - block_tables.shape[1]), generator=gen, device=block_tables.device
    )
    return torch.cat([block_tables, extra.to(block_tables.dtype)], dim=1)


def bench_cell(args, batch: int, context: int, device: torch.device, peak: float | None) -> list[dict]:
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    blocks_per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * blocks_per_seq
    kv_bytes = 2 * num_blocks * args.block_size * args.num_kv_heads * args.head_dim * itemsize
    read_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * itemsize
    read_bytes += batch * args.num_q_heads * args.head_dim * itemsize
    cell = {"batch": batch, "context": context}
    # Peak memory: the pool, one contiguous copy of all K/V ((b)'s gather output, or (c)'s inputs), and half a copy
    # in flight while (c)'s inputs are made contiguous; plus room for do_bench's L2-flush buffer.
    needed = int(2.5 * kv_bytes) + (512 << 20)
    if not fits_in_memory(needed, device):
        print(f"skip batch={batch} context={context}: needs ~{needed / 2**30:.1f} GiB", file=sys.stderr)
        return [{**cell, "method": "all", "skipped": "does not fit in memory"}]

    query, key_cache, value_cache, block_tables, seq_lens = decode_inputs(args, batch, context, args.head_dim, device)
    scale = args.head_dim**-0.5
    out = torch.empty_like(query)

    def paged():
        paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale, out=out, backend=args.backend
        )

    tables, workspace = PoolTables(key_cache, value_cache, block_tables, args.block_size), GatherWorkspace()

    def gather_then_sdpa():
        key, value = workspace.gather(tables, 0, 0, blocks_per_seq, 0, context)  # [B, Hkv, S, D] views
        return sdpa_decode(query, key, value, scale)

    backend = resolve_backend(args.backend, device)
    rows = [{**cell, "method": f"paged ({backend})", "ms": time_ms(paged, device, args.warmup_ms, args.rep_ms)}]
    rows[0]["graph_ms"] = graph_ms(paged, device, args.graph_rep_ms)
    if backend == "triton":
        from hf_paged.attention.kernels import launch_config
        from hf_paged.attention.kernels.triton_decode import choose_num_splits

        config = launch_config.decode_config(args.head_dim, DTYPES[args.dtype], launch_config.device_capability(device))
        context_len = blocks_per_seq * args.block_size
        rows[0]["num_splits"] = choose_num_splits(batch, args.num_kv_heads, context_len, device, config.block_n)
    rows[0]["out"] = out.float()
    if args.table_tokens > context:
        wide_tables = widened_tables(block_tables, math.ceil(args.table_tokens / args.block_size), num_blocks)

        def paged_wide():
            paged_decode_attention(
                query, key_cache, value_cache, wide_tables, seq_lens, scale=scale, out=out, backend=args.backend
            )

        method = f"paged ({backend}), table of {args.table_tokens} tokens"
        rows.append({**cell, "method": method, "ms": time_ms(paged_wide, device, args.warmup_ms, args.rep_ms)})
        rows[-1]["graph_ms"] = graph_ms(paged_wide, device, args.graph_rep_ms)
        if backend == "triton":
            table_len = wide_tables.shape[1] * args.block_size
            rows[-1]["num_splits"] = choose_num_splits(batch, args.num_kv_heads, table_len, device, config.block_n)
        rows[-1]["out"] = out.float()
    rows.append({**cell, "method": "gather+sdpa", "ms": time_ms(gather_then_sdpa, device, args.warmup_ms, args.rep_ms)})
    rows[-1]["graph_ms"] = graph_ms(gather_then_sdpa, device, args.graph_rep_ms)
    rows[-1]["out"] = gather_then_sdpa().float()
    tables = workspace = None  # keep the peak at the pool plus one copy

    key = gather_kv(key_cache, block_tables, context).contiguous()
    value = gather_kv(value_cache, block_tables, context).contiguous()
    key_cache = value_cache = None  # keep the peak at the pool plus one copy
    contiguous = lambda: sdpa_decode(query, key, value, scale)  # noqa: E731
    rows.append(
        {
            **cell,
            "method": "sdpa-contig",
            "ms": time_ms(contiguous, device, args.warmup_ms, args.rep_ms),
            "graph_ms": graph_ms(contiguous, device, args.graph_rep_ms),
        }
    )
    expected = sdpa_decode(query, key, value, scale).float()
    for row in rows:
        row["bytes"] = read_bytes
        row["bandwidth_gbs"] = read_bytes / (row["ms"] * 1e-3) / 1e9
        row["peak_fraction"] = read_bytes / (row["ms"] * 1e-3) / peak if peak else None
        if "out" in row:  # the paged runs' and the gather's
            row["max_abs_err_vs_sdpa"] = (expected - row.pop("out")).abs().max().item()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "CUDA is not available: this benchmark times GPU kernels. "
            "For a smoke run of the script on CPU: python bench/decode_attention.py --device cpu --tiny"
        )
        return 0
    device_name, peak = peak_bandwidth(device, args.peak_bandwidth)
    peak_text = f"{peak / 1e12:.2f} TB/s" if peak else "unknown (--peak-bandwidth)"
    print(
        f"device: {device_name}, peak bandwidth: {peak_text}; "
        f"{args.dtype}, {args.num_q_heads} q / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
        f"block_size {args.block_size}"
    )

    results = []
    for batch in args.batch_sizes:
        for context in args.context_lens:
            results.extend(bench_cell(args, batch, context, device, peak))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.json:  # after every cell: a run stopped early keeps what it measured
                report = {"device": device_name, "peak_bandwidth": peak, "args": vars(args), "results": results}
                write_report(args.json, report, quiet=True)

    table = [
        [
            r["batch"],
            r["context"],
            r["method"],
            r.get("skipped") or f"{r['ms'] * 1e3:.1f}",
            f"{r['graph_ms'] * 1e3:.1f}" if r.get("graph_ms") is not None else "",
            f"{r['bandwidth_gbs']:.1f}" if "ms" in r else "",
            f"{r['peak_fraction']:.0%}" if r.get("peak_fraction") is not None else "",
            r.get("num_splits", ""),
            f"{r['max_abs_err_vs_sdpa']:.1e}" if "max_abs_err_vs_sdpa" in r else "",
        ]
        for r in results
    ]
    headers = ["batch", "context", "method", "time (us)", "graph (us)", "GB/s", "% peak", "splits", "max |err|"]
    print(tabulate(table, headers=headers, disable_numparse=True))
    if args.json:
        write_report(args.json, {"device": device_name, "peak_bandwidth": peak, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
