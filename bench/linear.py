"""How the benchmark's model computes its linear layers on the CPU: `F.linear` as stock, or weight-major.

Decode multiplies a few rows (one per sequence in the step) by each weight. On the host SERVING_LOG.md comes from
(AMD EPYC, torch 2.13 with MKL), `F.linear(x, W)` = `x @ W.T` on 2-16 rows takes 2-3x as long as the same product
computed weight-major, `(W @ x.T).T`; at 1 row both take the matrix-vector path, which is as slow, and two columns
(the row twice) take the fast one. Over the default model's 43 weights (6 layers + LM head), one input of each
row count, best of 5 (an ad-hoc script; `make microbench` times the 3-row case, `test_default_model_linears_three_rows`:
median 11.4 ms stock, 4.0 ms weight-major):

    rows                  1     2     3     4     8    12    16    24    32
    F.linear      ms     6.3   8.9  11.0  10.0  10.9  12.8  13.0  14.9  17.6
    weight-major  ms     2.8   2.7   3.8   3.6   6.4  11.4   9.4  15.2  17.7

With F.linear every extra decode row costs 2-3 ms of a ~9 ms step, so the CPU harness mostly measured that BLAS
dispatch, not memory. Weight-major keeps a decode step's matmuls about flat in rows up to 4, as decode is on a GPU
(bandwidth-bound), which is the regime in which holding more sequences in the same memory pays. `--linear` picks it
for the whole run, so every backend (and the per-request references) runs the same model code.

Only CPU float32 weights change; from 17 rows on (prefill chunks) both ways cost about the same and `F.linear` runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

LINEARS = ("weight-major", "torch")
MAX_WEIGHT_MAJOR_ROWS = 16


def weight_major_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for `x` `[..., in_features]`, computed as `W @ x.T` when `x` has at most MAX_WEIGHT_MAJOR_ROWS
    rows; returns `[..., out_features]` (contiguous)."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_WEIGHT_MAJOR_ROWS or rows == 0:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    columns = flat.t() if rows > 1 else torch.cat([flat, flat]).t()  # 1 row: 2 columns take the matrix path
    out = torch.mm(module.weight, columns)[:, :rows].t()
    if module.bias is not None:
        out = out + module.bias
    return out.contiguous().reshape(*x.shape[:-1], module.out_features)


def use_linear(model: nn.Module, kind: str) -> int:
    """Make every `nn.Linear` of `model` whose weight is CPU float32 compute as `kind` ("weight-major" or "torch",
    the stock forward). Returns how many layers compute weight-major. A layer whose forward someone else replaced
    (accelerate's offloading hooks) is left alone."""
    if kind not in LINEARS:
        raise ValueError(f"linear must be one of {', '.join(LINEARS)}, got {kind!r}")
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        forward = module.__dict__.get("forward")
        if forward is not None:
            if getattr(forward, "func", None) is not weight_major_linear:
                continue
            del module.forward  # back to the class's forward
        if kind == "weight-major" and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.forward = functools.partial(weight_major_linear, module)
            count += 1
    return count
