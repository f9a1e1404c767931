"""`python -m bench.decode_tuning`: the decode kernel's launch choices tried on the GPU, beside the ones
`launch_config.decode_config` makes.

For each `--head-dims` (bf16, 32 q / 8 kv heads, block size 16, K/V stored head-major as a `BlockPool` stores them,
scattered block tables), every (BLOCK_N, num_warps, num_stages) of the grid below is timed on each cell (batch x
context, or batch x a range of lengths as the Engine's decode steps hold), replayed from a CUDA graph (the device's
time alone), its output checked against SDPA's (a range's against the PyTorch path). Per head_dim the report gives,
per cell, the default configuration's time, the best one's and what it is, and the configuration best over all cells
(the geometric mean of its time over each cell's best): the numbers `launch_config.py`'s table of choices is to be
made from. A configuration that spills registers is one CI refuses (tests/test_kernel_compile.py): check a new
choice there before taking it.

    python -m bench.decode_tuning --json bench/results/gpu/decode_tuning.json
    TRITON_INTERPRET=1 python -m bench.decode_tuning --device cpu --tiny      # a dry run in Triton's interpreter
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
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
    ragged_inputs,
    ragged_lengths,
    sdpa_decode,
)
from bench.host import device_name  # noqa: E402
from hf_paged.attention.kernels import gather_kv, launch_config  # noqa: E402

BLOCK_NS = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
# A thread's share of one K (or V) tile above this many elements spills whatever the rest (launch_config.py keeps 32).
MAX_TILE_ELEMENTS = 64


def candidates(
    default: launch_config.DecodeConfig, block_ns=BLOCK_NS, num_warps=NUM_WARPS, num_stages=NUM_STAGES
) -> list[launch_config.DecodeConfig]:
    """`default`, then every BLOCK_N, warps and stages of the grid whose K/V tile share per thread stays bounded."""
    grid = itertools.product(block_ns, num_warps, num_stages)
    configs = [
        dataclasses.replace(default, block_n=block_n, num_warps=warps, num_stages=stages)
        for block_n, warps, stages in grid
        if block_n * default.head_dim_pad // (32 * warps) <= MAX_TILE_ELEMENTS
    ]
    return [default, *(config for config in configs if config != default)]


@contextlib.contextmanager
def launched_with(config, chooser: str = "decode_config"):
    """The launcher that asks `launch_config.<chooser>` for its launch takes `config` whatever the shapes, while
    inside."""
    original = getattr(launch_config, chooser)
    setattr(launch_config, chooser, lambda *args: config)
    try:
        yield
    finally:
        setattr(launch_config, chooser, original)


def _label(config: launch_config.DecodeConfig) -> str:
    return f"N{config.block_n} w{config.num_warps} s{config.num_stages}"


def tune_head_dim(args, head_dim: int, device: torch.device, save=lambda result: None) -> dict:
    """Every candidate configuration of `head_dim` on every cell: times (ms), and the default configuration; `save`
    is called with what is measured after every cell."""
    default = launch_config.decode_config(head_dim, DTYPES[args.dtype], launch_config.device_capability(device))
    configs = candidates(default, args.block_ns, args.num_warps, args.num_stages)
    cells = []
    result = dict(head_dim=head_dim, default=_label(default), cells=cells)
    for batch, lo, hi in args.cells:
        times = tune_cell(args, head_dim, configs, batch, lo, hi, device)
        cells.append(dict(batch=batch, context=lo if lo == hi else f"{lo}-{hi}", times=times))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(result)
    return result


def tune_cell(args, head_dim: int, configs: list, batch: int, lo: int, hi: int, device: torch.device) -> dict:
    """{configuration: ms per call, or why it has no time} for `batch` sequences of `lo` cached tokens, or of lengths
    drawn uniformly from [lo, hi] (`bench.decode_splits`'s ragged rows, checked against the PyTorch path)."""
    from hf_paged.attention.kernels import paged_decode_attention_torch
    from hf_paged.attention.kernels.triton_decode import paged_decode_attention_triton

    inputs = ragged_inputs(args, ragged_lengths(batch, lo, hi), head_dim, device)
    query, key_cache, value_cache, block_tables, seq_lens = inputs
    scale, out = head_dim**-0.5, torch.empty_like(query)
    if lo == hi:
        keys, values = gather_kv(key_cache, block_tables, lo), gather_kv(value_cache, block_tables, lo)
        expected = sdpa_decode(query, keys, values, scale).float()
    else:
        expected = paged_decode_attention_torch(*inputs, scale=scale).float()

    def paged():
        paged_decode_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, scale=scale, out=out)

    return time_configs(args, configs, paged, out, expected, device, _label)


def time_configs(args, configs: list, run, out, expected, device, label, chooser: str = "decode_config") -> dict:
    """{label(configuration): ms per `run()` under it, replayed from a CUDA graph where one captures, or why it has
    no time}: each configuration's `out` is first checked against `expected` to `args.tolerance`."""
    times = {}
    for config in configs:
        with launched_with(config, chooser):
            times[label(config)] = checked_ms(args, run, out, expected, device)
    return times


def best_overall(result: dict) -> tuple[str, float] | None:
    """The configuration whose times over every cell are nearest each cell's best (geometric mean of the ratios)."""
    cells = [{k: v for k, v in cell["times"].items() if isinstance(v, float)} for cell in result["cells"]]
    common = set.intersection(*(set(times) for times in cells)) if cells else set()
    if not common:
        return None
    score = {
        label: math.exp(sum(math.log(times[label] / min(times.values())) for times in cells) / len(cells))
        for label in common
    }
    label = min(score, key=score.get)
    return label, score[label]


def table(result: dict, context_label: str = "context") -> str:
    rows = []
    for cell in result["cells"]:
        times = {k: v for k, v in cell["times"].items() if isinstance(v, float)}
        default = times.get(result["default"])
        best = min(times, key=times.get) if times else None
        rows.append(
            [
                cell["batch"],
                cell["context"],
                "" if default is None else f"{default * 1e3:.1f}",
                "" if best is None else f"{times[best] * 1e3:.1f}",
                best or "",
                "" if default is None or best is None else f"{default / times[best]:.2f}x",
                sum(1 for v in cell["times"].values() if not isinstance(v, float)),
            ]
        )
    headers = ["batch", context_label, f"default {result['default']} (us)", "best (us)", "best", "speedup", "failed"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def add_grid_arguments(
    parser: argparse.ArgumentParser, block_ns, *, rep_ms: float, tolerance: float, num_stages=NUM_STAGES
) -> None:
    """The shapes, the grid and the output of a tuning run (this one's and bench/prefill_tuning.py's)."""
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--block-ns", type=int, nargs="+", default=list(block_ns))
    parser.add_argument("--num-warps", type=int, nargs="+", default=list(NUM_WARPS))
    parser.add_argument("--num-stages", type=int, nargs="+", default=list(num_stages))
    parser.add_argument("--rep-ms", type=float, default=rep_ms)
    parser.add_argument("--tolerance", type=float, default=tolerance, help="largest |error| against SDPA accepted")
    parser.add_argument("--json", help="write the results here")


def make_tiny(args, cells: list[str]) -> None:
    """A dry run's sizes: head_dim 32 on `cells`, 4 q / 2 kv heads, fp32 (checked to 1e-4), one warp count and one
    stage count, short timings."""
    args.head_dims, args.cells, args.num_q_heads, args.num_kv_heads, args.dtype = [32], cells, 4, 2, "fp32"
    args.tolerance, args.num_warps, args.num_stages, args.rep_ms = 1e-4, [4], [2], 1.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.decode_tuning", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    # 48 rows of 128-1280 tokens: the Engine's decode steps on the GPU workload (about 47 rows of its burst's lengths)
    cells = ["8x512", "8x8192", "32x8192", "48x128-1280"]
    parser.add_argument("--cells", type=str, nargs="+", default=cells, help="BATCHxCONTEXT or BATCHxLO-HI")
    add_grid_arguments(parser, BLOCK_NS, rep_ms=10.0, tolerance=2e-2)
    parser.add_argument(
        "--tiny", action="store_true", help="head_dim 32, cells 1x32 2x64 3x8-64, 4/2 heads, fp32, 2 configs"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        make_tiny(args, ["1x32", "2x64", "3x8-64"])
        args.block_ns = [16, 32]
    args.cells = [parse_cell(cell) for cell in args.cells]
    return args


def main(argv=None) -> int:
    return run(parse_args(argv), tune_head_dim, "bench.decode_tuning")


def run(args, tune, prog: str, context_label: str = "context") -> int:
    """Tune every `args.head_dims` with `tune(args, head_dim, device, save)`, print each one's table (its cells'
    second column named `context_label`) and write the JSON as it goes; what `main` of `prog` does."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: this tunes a GPU kernel (a dry run on CPU: --device cpu --tiny)")
        return 0
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # It must be set before Triton decorates the kernels' helpers, at import: here is too late.
        print(f"On CPU the kernel runs in Triton's interpreter: TRITON_INTERPRET=1 python -m {prog} ...")
        return 2
    results = []

    def save(result: dict) -> None:  # after every cell: a run stopped early keeps what it measured
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            report = {"device": device_name(device.type), "args": vars(args), "results": [*results, result]}
            Path(args.json).write_text(json.dumps(report, indent=1))

    for head_dim in args.head_dims:
        result = tune(args, head_dim, device, save)
        results.append(result)
        overall = best_overall(result)
        print(f"head_dim {head_dim}, {args.dtype}, {args.num_q_heads} q / {args.num_kv_heads} kv heads", flush=True)
        print(table(result, context_label))
        if overall is not None:
            print(f"best over every cell: {overall[0]} ({overall[1]:.2f}x the best of each cell, geometric mean)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
