"""`python -m bench.decode_splits`: the decode kernel's split-K count tried on ragged batches, beside the one
`triton_decode.choose_num_splits` picks.

The Engine's decode steps hold rows of many lengths (the GPU workload's burst: prompts of 128-1024 tokens growing by
up to 256), and once batch x kv heads programs fill the SMs the kernel does not split: the longest rows' programs
then set the step's time while most SMs have finished. Each cell here is `batch` rows of lengths drawn uniformly
(seeded) from `lo-hi`; every split count of `--splits` is timed on it replayed from a CUDA graph (bf16, 32 q / 8 kv
heads, block size 16, K/V stored head-major as a `BlockPool` stores them, scattered block tables, each row's chunks
cut from its own length), its output checked against the PyTorch path. The bandwidth counts the bytes of K/V the
rows hold: the numbers a rule for splitting batches that fill the GPU is to be made from.

    python -m bench.decode_splits --json bench/results/gpu/decode_splits.json
    TRITON_INTERPRET=1 python -m bench.decode_splits --device cpu --tiny      # a dry run in Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_attention import (  # noqa: E402
    DTYPES,
    checked_ms,
    parse_cell,
    peak_bandwidth,
    ragged_inputs,
    ragged_lengths,
)
from bench.host import device_name  # noqa: E402
from hf_paged.attention.kernels import launch_config  # noqa: E402

CELLS = ("16x128-1280", "32x128-1280", "64x128-1280", "128x128-1280", "32x512-4096", "8x512-512")
SPLITS = (1, 2, 4, 8)


def time_cell(args, head_dim: int, batch: int, lo: int, hi: int, device: torch.device) -> dict:
    """{split count: ms per call, or why it has no time}, the chosen count and the bytes the rows' K/V hold."""
    from hf_paged.attention.kernels import paged_decode_attention_torch
    from hf_paged.attention.kernels.triton_decode import choose_num_splits, paged_decode_attention_triton

    lengths = ragged_lengths(batch, lo, hi)
    query, key_cache, value_cache, tables, seq_lens = ragged_inputs(args, lengths, head_dim, device)
    scale, out = head_dim**-0.5, torch.empty_like(query)
    expected = paged_decode_attention_torch(query, key_cache, value_cache, tables, seq_lens, scale=scale).float()
    config = launch_config.decode_config(head_dim, query.dtype, launch_config.device_capability(device))
    chosen = choose_num_splits(batch, args.num_kv_heads, tables.shape[1] * args.block_size, device, config.block_n)
    times = {}
    for num_splits in sorted({*args.splits, chosen}):

        def run(num_splits=num_splits):
            paged_decode_attention_triton(
                query, key_cache, value_cache, tables, seq_lens, scale=scale, out=out, num_splits=num_splits
            )

        times[str(num_splits)] = checked_ms(args, run, out, expected, device)
    itemsize = torch.empty((), dtype=query.dtype).element_size()
    kv_bytes = 2 * sum(lengths) * args.num_kv_heads * head_dim * itemsize
    return dict(batch=batch, lengths=f"{lo}-{hi}", chosen=chosen, kv_bytes=kv_bytes, times=times)


def table(result: dict, peak: float | None) -> str:
    splits = sorted({int(k) for cell in result["cells"] for k in cell["times"]})
    rows = []
    for cell in result["cells"]:
        times = {int(k): v for k, v in cell["times"].items() if isinstance(v, float)}
        best = min(times, key=times.get) if times else None
        chosen = times.get(cell["chosen"])
        rows.append(
            [
                cell["batch"],
                cell["lengths"],
                *(_us(cell["times"].get(str(s))) for s in splits),
                cell["chosen"],
                best or "",
                "" if chosen is None or best is None else f"{chosen / times[best]:.2f}x",
                "" if best is None or not peak else f"{cell['kv_bytes'] / (times[best] * 1e-3) / peak:.0%}",
            ]
        )
    headers = ["batch", "lengths", *(f"{s} split{'s' * (s > 1)} (us)" for s in splits), "chosen", "best"]
    headers += ["chosen / best time", "best's % of HBM peak"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _us(value) -> str:
    if value is None:
        return ""
    return f"{value * 1e3:.1f}" if isinstance(value, float) else value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.decode_splits", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--cells", nargs="+", default=list(CELLS), help="BATCHxLO-HI: rows and their lengths' range")
    parser.add_argument("--splits", type=int, nargs="+", default=list(SPLITS))
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rep-ms", type=float, default=10.0)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest |error| against the PyTorch path")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tiny", action="store_true", help="head_dim 32, cells 3x8-100 2x64, 4/2 heads, fp32")
    args = parser.parse_args(argv)
    if args.tiny:
        args.head_dims, args.cells, args.num_q_heads, args.num_kv_heads, args.dtype = (
            [32],
            ["3x8-100", "2x64"],
            4,
            2,
            "fp32",
        )
        args.splits, args.tolerance, args.rep_ms = [1, 2], 1e-4, 1.0
    args.cells = [parse_cell(cell) for cell in args.cells]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: this times a GPU kernel (a dry run on CPU: --device cpu --tiny)")
        return 0
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("On CPU the kernel runs in Triton's interpreter: TRITON_INTERPRET=1 python -m bench.decode_splits ...")
        return 2
    _, peak = peak_bandwidth(device, None)
    results = []
    for head_dim in args.head_dims:
        result = dict(head_dim=head_dim, cells=[])
        results.append(result)
        for batch, lo, hi in args.cells:
            result["cells"].append(time_cell(args, head_dim, batch, lo, hi, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.json:  # after every cell: a run stopped early keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                report = {"device": device_name(device.type), "peak_bandwidth": peak, "args": vars(args)}
                Path(args.json).write_text(json.dumps({**report, "results": results}, indent=1))
        print(f"head_dim {head_dim}, {args.dtype}, {args.num_q_heads} q / {args.num_kv_heads} kv heads", flush=True)
        print(table(result, peak) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
