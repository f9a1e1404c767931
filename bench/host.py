"""The machine a benchmark ran on, as its reports name it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def host() -> str:
    """The CPU's model name with its cores and hardware threads, e.g. "AMD EPYC (2 cores, 2 threads)" (/proc/cpuinfo
    on Linux; the machine type and thread count elsewhere): CPU timings depend on all three."""
    name, cores = None, set()
    try:
        physical = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and name is None:
                name = value
            elif key == "physical id":
                physical = value
            elif key == "core id":
                cores.add((physical, value))
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    threads = os.cpu_count()
    counts = ([f"{len(cores)} cores"] if cores else []) + ([f"{threads} threads"] if threads else [])
    return f"{name} ({', '.join(counts)})" if counts else name


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the device type."""
    import torch

    return torch.cuda.get_device_name(device) if str(device).startswith("cuda") else str(device)


def versions() -> dict[str, str]:
    """torch, transformers and (where installed) triton versions, as a GPU report names them."""
    import torch
    import transformers

    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        pass
    return found
