"""bench/launch_overhead.py: the Triton launches' host time with the driver stood in, on a machine without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_each_launcher_and_a_decode_step_are_timed_with_the_launches_stood_in():
    # Its own process: the kernels must be Triton's JIT functions, which TRITON_INTERPRET (set by conftest.py) is not.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "bench.launch_overhead", "--calls", "20", "--rows", "1", "--steps", "3"]
    result = subprocess.run(
        [*command, "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # Every launcher's launches counted: one a call, two with split-K (the merge); each timed both ways.
    launches = dict(
        re.findall(r"\| ((?:decode|store), batch 1\b[^|]*?) +\| +(\d) +\| +[\d.]+ +\| +[\d.]+ +\| [\d.]+x", out)
    )
    assert launches == {
        "decode, batch 1 (2 splits): a layer of a step": "2",
        "decode, batch 1: paged_decode_attention_triton": "2",
        "store, batch 1: a layer's StoreLaunch": "1",
    }, out
    for name in (
        "DynamicCache",
        "PagedCache, sdpa",
        'PagedCache, "hf_paged" (launches stood in)',
        'PagedCache, "hf_paged", launches through JITFunction.run',
    ):
        # tabulate aligns the numbers on their decimal point (4.38 is padded where 4.382 is not)
        assert re.search(rf"\| +1 \| {re.escape(name)} +\| +\d+(\.\d+)? +\|", out), out


def test_it_refuses_interpreted_kernels(monkeypatch):
    from bench import launch_overhead

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        launch_overhead.stand_in_launches()
