"""`python -m bench --tp N`: the serving benchmark on a tensor-parallel model, N ranks under torchrun.

    python -m bench --tp 2 --serving-only                 # relaunches itself: torchrun --nproc-per-node 2 -m bench
    torchrun --nproc-per-node 2 --standalone -m bench --tp 2 --serving-only   # the same, launched by hand

Every rank loads the model with `tp_plan="auto"` (the embedded model: its seeded random weights, saved with
`save_pretrained` and loaded back sharded) and runs every backend on the same workload in the same order, since each
forward is a collective; rank 0 prints and writes the report. KV budgets are per rank: a rank holds its share of the
kv heads, so a budget's bytes buy the same tokens on every rank as on one device for the whole model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

# Backends that run a sharded model: generate() with DynamicCache or PagedCache, and the Engine in lockstep.
# StaticCache and transformers' continuous batching size their K/V from the config's heads.
TP_BACKENDS = ("dynamic", "paged-generate", "engine")


def launched_ranks() -> int:
    """The ranks of the torchrun launch this process is part of (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def relaunch(tp: int, argv: list[str]) -> int:
    """Run `python -m bench ARGV` on `tp` ranks under torchrun; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--standalone"]
    return subprocess.run([*command, "-m", "bench", *argv]).returncode


def init_ranks(tp: int) -> int:
    """Join the torchrun launch (nccl on CUDA, gloo on CPU); this rank's number."""
    if launched_ranks() != tp:
        raise SystemExit(f"--tp {tp} but torchrun started {launched_ranks()} ranks (--nproc-per-node); make them equal")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank()


def load_sharded(path: str | None, whole_model, dtype: torch.dtype | None):
    """`from_pretrained(path, tp_plan="auto")`; without a path, `whole_model` (the embedded one) saved by rank 0 to
    a temporary folder (`save_pretrained` writes on the main process only) and loaded back sharded by every rank."""
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype or "auto").eval()
    folder = [tempfile.mkdtemp(prefix="bench-tp-") if dist.get_rank() == 0 else None]
    try:
        if dist.get_rank() == 0:
            whole_model.save_pretrained(folder[0])
        dist.broadcast_object_list(folder, src=0)  # also waits for rank 0's save
        model = AutoModelForCausalLM.from_pretrained(folder[0], tp_plan="auto", dtype=whole_model.dtype)
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    return model.eval()
