"""bench/decode_tuning.py: the decode kernel's launch choices tried beside its defaults (a dry run in Triton's
interpreter here; on a GPU, `make bench-gpu`)."""

import json

import torch
from models import require_triton_on_cpu

from bench.decode_tuning import best_overall, candidates, launched_with, main
from bench.gpu_report import _tuning_section
from hf_paged.attention.kernels import launch_config


def test_the_grid_starts_with_the_default_and_bounds_each_threads_tile():
    default = launch_config.decode_config(128, torch.bfloat16, 90)
    configs = candidates(default)
    assert configs[0] == default and len(set(configs)) == len(configs)
    assert all(c.block_n * c.head_dim_pad // (32 * c.num_warps) <= 64 for c in configs[1:])
    assert {(c.head_dim_pad, c.block_g, c.dot_precision) for c in configs} == {(128, 16, "tf32")}
    with launched_with(configs[-1]):
        assert launch_config.decode_config(64, torch.float16, 80) == configs[-1]
    assert launch_config.decode_config(128, torch.bfloat16, 90) == default  # put back


def test_the_best_configuration_over_every_cell_is_the_geometric_mean_of_its_ratios():
    result = {
        "cells": [
            {"times": {"a": 1.0, "b": 2.0, "c": "wrong (max |err| 1e-1)"}},
            {"times": {"a": 4.0, "b": 2.0, "c": 1.0}},
        ]
    }
    # a: sqrt(1 * 4) = 2, b: sqrt(2 * 2) = 2 over the cells' best (1 and 1): a tie broken by order; c failed a cell
    label, score = best_overall(result)
    assert label in ("a", "b") and score == 2.0
    result["cells"][1]["times"]["a"] = 8.0
    assert best_overall(result) == ("b", 2.0)


def test_a_dry_run_times_each_configuration_and_the_report_shows_the_best(tmp_path):
    require_triton_on_cpu()
    path = tmp_path / "decode_tuning.json"
    assert main(["--device", "cpu", "--tiny", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    (result,) = report["results"]
    assert result["default"] == "N64 w4 s2" and [(c["batch"], c["context"]) for c in result["cells"]] == [
        (1, 32),
        (2, 64),
        (3, "8-64"),  # rows of lengths drawn from 8-64, checked against the PyTorch path
    ]
    for cell in result["cells"]:  # the default and the grid's two tiles, each right and timed
        assert set(cell["times"]) == {"N64 w4 s2", "N16 w4 s2", "N32 w4 s2"}
        assert all(isinstance(ms, float) and ms > 0 for ms in cell["times"].values())
    section = _tuning_section(tmp_path)
    assert "#### decode, head_dim 32" in section and "Best over every cell" in section


def test_a_dry_run_of_the_split_counts_times_each_count_on_ragged_rows_and_the_report_shows_them(tmp_path):
    """`python -m bench.decode_splits --tiny`: each cell's rows of lengths drawn from its range, every split count
    asked for (and the chosen one) right against the PyTorch path and timed, the chosen count named."""
    from bench.decode_attention import parse_cell, ragged_lengths
    from bench.decode_splits import main as splits_main

    require_triton_on_cpu()
    assert parse_cell("32x128-1280") == (32, 128, 1280) and parse_cell("8x512") == (8, 512, 512)
    lengths = ragged_lengths(64, 128, 1280)
    assert (
        min(lengths) >= 128
        and max(lengths) <= 1280
        and len(set(lengths)) > 32
        and lengths == ragged_lengths(64, 128, 1280)
    )
    path = tmp_path / "decode_splits.json"
    assert splits_main(["--device", "cpu", "--tiny", "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())["results"]
    assert result["head_dim"] == 32 and [(c["batch"], c["lengths"]) for c in result["cells"]] == [
        (3, "8-100"),
        (2, "64-64"),
    ]
    for cell in result["cells"]:
        assert cell["chosen"] == 1  # one "SM" off CUDA: the grid fills it
        assert set(cell["times"]) == {"1", "2"} and all(
            isinstance(ms, float) and ms > 0 for ms in cell["times"].values()
        )
    section = _tuning_section(tmp_path)
    assert "#### split counts, head_dim 32" in section and "2 splits (us)" in section
