"""bench/host_ops.py: one step's host operations on the CUDA branch, counted on CPU (its own process: it forces the
Triton backend through the environment)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_step_is_counted_with_its_launches_and_host_reads():
    command = [sys.executable, "-m", "bench.host_ops", "--layers", "2", "--rows", "4"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {
        cells[0]: [float(cell) for cell in cells[1:]]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| step")
        for cells in [[cell.strip() for cell in line.strip("|").split("|") if cell.strip()]]
    }
    python = {name: cells.pop() for name, cells in rows.items() if name.startswith("generate step")}
    ops, _, launches, _, reads = zip(*rows.values())
    assert len(rows) == 5 and all(n > 0 for n in ops)
    # 2 layers: the decode runner stores and attends (2 launches a layer), the mixed step prefills too (3)
    assert [rows["engine decode, 4 rows"][2], rows["engine mixed, 4 rows + 2 prompts"][2]] == [4, 6]
    assert rows["engine decode, 4 rows"][4] == rows["engine mixed, 4 rows + 2 prompts"][4] == 1  # the tokens' read
    assert rows["generate step, DynamicCache"][2] == 0 and rows["generate step, PagedCache, sdpa"][2] == 2
    assert rows["generate step, PagedCache, hf_paged"][2] == 4  # store and decode kernel a layer
    # Python calls a layer of a decode step, over DynamicCache's (the model's own are in both): the store's and the
    # decode kernel's launches are made once per step (`StoreLaunch`, `DecodeLaunch`), not chosen at every layer.
    # Measured at 2 layers: 45.5 (sdpa) and 77 ("hf_paged") over DynamicCache's 230.5; 57.5 and 96.5 before the
    # launch objects. A launch counts `DirectKernel.launch` (direct.py), the lookup that replaces JITFunction.run's
    # binding on a GPU; Triton's own calls are left out of the count either way (its launch is stood in).
    dynamic = python["generate step, DynamicCache"]
    assert python["generate step, PagedCache, sdpa"] - dynamic <= 46
    assert python["generate step, PagedCache, hf_paged"] - dynamic <= 78
