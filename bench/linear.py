"""How the benchmark's model computes its linear layers on the CPU: `F.linear` as stock, or weight-major, or
whichever of the two is faster on this host for each row count (`auto`, the default).

Decode multiplies a few rows (one per sequence in the step) by each weight, and which BLAS path is faster for that
depends on the host's CPU and BLAS. On some hosts (AMD EPYC with MKL), `F.linear(x, W)` = `x @ W.T` on 2-16 rows
takes several times as long as the same product computed weight-major, `(W @ x.T).T`; at 1 row both take the
matrix-vector path, which is as slow, and two columns (the row twice) take the fast one. On others (Intel Xeon with
AVX-512 and AMX) stock `F.linear` is the faster way at small row counts, and the two meet near 16 rows.

A fixed choice therefore slows every backend down on one host or the other, and the slower path mostly measures a
BLAS dispatch, not memory. `auto` times both on this model (`calibrate`) and computes each row count the faster
way, for every backend and the per-request references alike; the log's header records the choice and the timings
behind it. `--linear weight-major` / `--linear torch` force one; `make microbench` times the 3-row case
(`test_default_model_linears_three_rows`).

Only CPU float32 weights change; from 17 rows on (prefill chunks) both ways cost about the same and `F.linear` runs.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

LINEARS = ("auto", "weight-major", "torch")
MAX_WEIGHT_MAJOR_ROWS = 16
ALL_ROWS = frozenset(range(1, MAX_WEIGHT_MAJOR_ROWS + 1))


def weight_major_linear(module: nn.Linear, x: torch.Tensor, rows_set: frozenset[int] = ALL_ROWS) -> torch.Tensor:
    """`module(x)` for `x` `[..., in_features]`, computed as `W @ x.T` when `x` has a row count in `rows_set` (at most
    MAX_WEIGHT_MAJOR_ROWS; default: all of 1..MAX_WEIGHT_MAJOR_ROWS), else `F.linear`; returns
    `[..., out_features]` (contiguous)."""
    rows = x.numel() // x.shape[-1]
    if rows not in rows_set:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    columns = flat.t() if rows > 1 else torch.cat([flat, flat]).t()  # 1 row: 2 columns take the matrix path
    out = torch.mm(module.weight, columns)[:, :rows].t()
    if module.bias is not None:
        out = out + module.bias
    return out.contiguous().reshape(*x.shape[:-1], module.out_features)


def _stock_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _is_cpu_float32(module: nn.Linear) -> bool:
    return module.weight.device.type == "cpu" and module.weight.dtype == torch.float32


def calibrate(model: nn.Module, *, repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Per row count r in 1..MAX_WEIGHT_MAJOR_ROWS: (ms stock, ms weight-major) to pass one [r, in_features] input
    through every CPU float32 linear layer of `model`, the fastest of `repeats` (the two ways interleaved, so a
    slow moment on the host hits both). Empty when the model has no such layer."""
    layers = [module for module in model.modules() if isinstance(module, nn.Linear) and _is_cpu_float32(module)]
    if not layers:
        return {}
    generator = torch.Generator().manual_seed(0)
    timings = {}
    with torch.inference_mode():
        for rows in sorted(ALL_ROWS):
            inputs = {
                features: torch.randn(rows, features, generator=generator)
                for features in {layer.in_features for layer in layers}
            }
            best = [float("inf"), float("inf")]
            for _ in range(repeats):
                for way, forward in enumerate((_stock_linear, weight_major_linear)):
                    start = time.perf_counter()
                    for layer in layers:
                        forward(layer, inputs[layer.in_features])
                    best[way] = min(best[way], time.perf_counter() - start)
            timings[rows] = (best[0] * 1e3, best[1] * 1e3)
    return timings


def use_linear(model: nn.Module, kind: str, *, weight_major_rows: frozenset[int] | None = None) -> int:
    """Make every `nn.Linear` of `model` whose weight is CPU float32 compute as `kind`: "weight-major" (for the row
    counts in `weight_major_rows`, default all of 1..MAX_WEIGHT_MAJOR_ROWS; `F.linear` for the others, so an empty
    set is stock) or "torch" (the stock forward). Returns how many layers compute weight-major for some row count.
    A layer whose forward someone else replaced (accelerate's offloading hooks) is left alone. For "auto", see
    `pick_linear`."""
    if kind not in ("weight-major", "torch"):
        raise ValueError(f"linear must be one of {', '.join(LINEARS)}, got {kind!r}")
    rows_set = ALL_ROWS if weight_major_rows is None else frozenset(weight_major_rows)
    if not rows_set <= ALL_ROWS:
        raise ValueError(f"weight_major_rows must be within 1..{MAX_WEIGHT_MAJOR_ROWS}, got {sorted(rows_set)}")
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        forward = module.__dict__.get("forward")
        if forward is not None:
            if getattr(forward, "func", None) is not weight_major_linear:
                continue
            del module.forward  # back to the class's forward
        if kind == "weight-major" and rows_set and _is_cpu_float32(module):
            module.forward = functools.partial(weight_major_linear, module, rows_set=rows_set)
            count += 1
    return count


def pick_linear(model: nn.Module, kind: str) -> tuple[frozenset[int], dict[int, tuple[float, float]]]:
    """Apply `kind` ("auto", "weight-major" or "torch") to `model`; returns (row counts computed weight-major,
    the calibration `auto` measured, else {}). `auto` computes weight-major the row counts where `calibrate`
    found it faster than stock."""
    if kind not in LINEARS:
        raise ValueError(f"linear must be one of {', '.join(LINEARS)}, got {kind!r}")
    if kind != "auto":
        num_weight_major = use_linear(model, kind)  # "torch" also undoes an earlier weight-major forward
        return (ALL_ROWS if num_weight_major else frozenset()), {}
    use_linear(model, "torch")  # calibrate from the stock forward
    timings = calibrate(model)
    rows = frozenset(r for r, (stock, weight_major) in timings.items() if weight_major < stock)
    use_linear(model, "weight-major", weight_major_rows=rows)
    return rows, timings


def describe_linear(kind: str, rows: frozenset[int], timings: dict[int, tuple[float, float]]) -> str:
    """One line for the log's header: the choice, and for `auto` the calibration behind it."""
    if not rows and (kind == "weight-major" or (kind == "auto" and not timings)):
        choice = "no CPU float32 linear layer (stock F.linear)"  # a GPU or bf16 model: nothing to change
    elif not rows:
        choice = "stock F.linear at every row count"
    elif rows == ALL_ROWS:
        choice = f"weight-major at 1-{MAX_WEIGHT_MAJOR_ROWS} rows"
    else:
        choice = f"weight-major at rows {','.join(map(str, sorted(rows)))}, stock F.linear otherwise"
    if timings:
        table = "; ".join(f"{r}: {stock:.1f}/{major:.1f}" for r, (stock, major) in sorted(timings.items()))
        choice += f" (calibrated, ms stock/weight-major per row count: {table})"
    return f"{kind}: {choice}; bench/linear.py"
