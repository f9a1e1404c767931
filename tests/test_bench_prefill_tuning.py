"""bench/prefill_tuning.py: the prefill kernel's launch choices tried beside its defaults (a dry run in Triton's
interpreter here; on a GPU, `make bench-gpu`)."""

import dataclasses
import json

import torch
from models import require_triton_on_cpu

from bench.gpu_report import _tuning_section
from bench.prefill_tuning import candidates, launched_with, main
from hf_paged.attention.kernels import launch_config


def test_the_grid_starts_with_the_default_and_bounds_each_threads_tiles():
    default = launch_config.prefill_config(128, 4, torch.bfloat16, 90)
    configs = candidates(default)
    assert configs[0] == default and len(set(configs)) == len(configs) == 13
    # then the default's tiles in the grid's ascending order, the only candidate in that order
    assert configs[1] == dataclasses.replace(default, heavy_first=False)
    assert [c.heavy_first for c in configs] == [True, False] + [True] * 11
    assert {(c.block_m, c.num_warps) for c in configs} >= {(128, 8), (64, 4), (64, 8)}  # 128 rows need 8 warps here
    for config in configs:
        assert max(config.block_m, config.block_n) * config.head_dim_pad // (32 * config.num_warps) <= 64
        assert config.block_q * config.heads == config.block_m and config.heads == default.heads
    # K/V tiles of 128 keys up to 64 wide only (at 128 wide they spill on sm_90)
    assert 128 not in {c.block_n for c in configs}
    narrow = candidates(launch_config.prefill_config(64, 4, torch.bfloat16, 90))
    assert {(c.block_m, c.block_n, c.num_warps) for c in narrow} >= {(128, 128, 8), (64, 128, 4), (128, 64, 4)}
    with launched_with(configs[-1]):
        assert launch_config.prefill_config(64, 1, torch.float16, 80) == configs[-1]
    assert launch_config.prefill_config(128, 4, torch.bfloat16, 90) == default  # put back


def test_a_dry_run_times_each_configuration_against_sdpa(tmp_path, capsys):
    require_triton_on_cpu()
    path = tmp_path / "prefill_tuning.json"
    assert main(["--device", "cpu", "--tiny", "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())["results"]
    assert result["default"] == "M32 N16 w4 s1" and [c["context"] for c in result["cells"]] == ["24+0", "8+20"]
    # the default (in both orders) and the grid's one tile, each right (within 1e-4 of SDPA) and timed
    for cell in result["cells"]:
        assert set(cell["times"]) == {"M32 N16 w4 s1", "M32 N16 w4 s1 ascending", "M16 N16 w4 s2"}
        assert all(isinstance(ms, float) and ms > 0 for ms in cell["times"].values())
    assert "| new+cached" in capsys.readouterr().out
    section = _tuning_section(tmp_path)
    assert "### prefill kernel" in section and "#### prefill, head_dim 32" in section
    assert "default M32 N16 w4 s1 (us)" in section and "Best over every cell: M" in section
