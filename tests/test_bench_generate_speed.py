"""bench/generate_speed.py as a dry run on CPU: a 2-layer model, every variant, the report section it feeds."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_times_every_variant_and_finds_their_tokens_identical(tmp_path, monkeypatch):
    out = tmp_path / "generate.json"
    argv = ["generate_speed.py", "--tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "10"]
    argv += [
        "--new-tokens",
        "3",
        "--check-tokens",
        "4",
        "--trace-steps",
        "5",
        "--repeats",
        "1",
        "--compile-all-devices",
        "--host-profile",
        "3",
        "--profile-batch",
        "2",
    ]
    argv += ["--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(ROOT / "bench" / "generate_speed.py"), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0
    report = json.loads(out.read_text())
    variants = {"dynamic", "paged", "paged+hf_paged", "paged+torch-store", "paged+contiguous-kv"}
    variants |= {"static-compiled", "paged-compiled", "paged+hf_paged-compiled"}
    assert {r["variant"] for r in report["speed"]} == variants
    assert all(r["ms_per_token"] > 0 for r in report["speed"])
    # the prompt's forward timed alone, and the decode steps' time per token without it
    assert all(r["prompt_ms"] > 0 and r["decode_ms_per_token"] >= 0 for r in report["speed"])
    assert all(r["decode_ms_per_token"] * 2 <= r["ms_per_token"] * 3 for r in report["speed"])
    assert [(r["identical_rows"], r["rows"]) for r in report["identity"]] == [(2, 2)] * 8
    # The teacher-forced trace in the speed dtype: on CPU every variant's logits are DynamicCache's, bit for bit; SDPA
    # got the pool's strided view from PagedCache, and a contiguous copy where the variant asks for one.
    trace = {v["variant"]: v for v in report["trace"]["variants"]}
    assert set(trace) == {"paged", "paged, contiguous K/V", "paged+hf_paged"}
    assert all(v["differing_steps"] == [] and v["max_abs_diff"] == 0.0 for v in trace.values())
    assert all(entry.endswith("K contiguous") for entry in report["trace"]["dynamic_sdpa"])
    assert any("K strided" in entry for entry in trace["paged"]["sdpa"])
    assert all(entry.endswith("K contiguous") for entry in trace["paged, contiguous K/V"]["sdpa"])
    # The eager variants' host time under cProfile: hf_paged's own code shows for PagedCache only.
    host = report["host_profile"]
    assert set(host) == {"dynamic", "paged", "paged+hf_paged", "paged+torch-store", "paged+contiguous-kv"}
    assert all(p["ms_per_token"] > 0 and len(p["top"]) == 15 for p in host.values())
    assert host["paged"]["ms_per_token_by_group"]["hf_paged"] > 0
    assert "hf_paged" not in host["dynamic"]["ms_per_token_by_group"]
    assert host["paged"]["ms_per_token_by_group"]["transformers"] > 0
    # The same runs' ATen operators under torch.profiler (CUDA runtime calls on a GPU only): PagedCache's store and
    # views of the pool are more operators than DynamicCache's concatenations.
    ops = report["op_profile"]
    assert set(ops) == set(host) and all(p["runtime"] == {} for p in ops.values())
    assert all(p["aten_us_per_token"] > 0 and len(p["top"]) == 10 for p in ops.values())
    assert ops["paged"]["aten_calls_per_token"] > ops["dynamic"]["aten_calls_per_token"] > 0
    assert ops["paged+contiguous-kv"]["aten_calls_per_token"] > ops["paged"]["aten_calls_per_token"]  # the copies
    assert all(p["kernels"] == [] and p["kernel_us_per_token"] == 0 for p in ops.values())  # no GPU kernels on CPU

    from bench.gpu_report import _generate_section

    section = _generate_section(tmp_path)
    assert "paged+hf_paged-compiled" in section and "2/2" in section
    assert "| prompt ms " in section and "decode speed vs DynamicCache" in section
    assert "| paged, contiguous K/V " in section and "first step with other logits" in section
    assert "Most own host time, paged+hf_paged" in section and "Host time under cProfile" in section
    assert "Operators under torch.profiler, batch 2" in section and "Host time under cProfile, batch 2" in section
    assert "Most own host time among ATen operators, paged" in section and "GPU kernel time" not in section

    # The compiled variants' own step (bench/gpu_report.py runs them apart) joins the same table.
    compiled = dict(report, speed=[r for r in report["speed"] if r["variant"] in ("dynamic", "paged-compiled")])
    (tmp_path / "generate_compiled.json").write_text(json.dumps(compiled))
    merged = _generate_section(tmp_path)
    assert merged.count("| paged-compiled ") == 2 * section.count("| paged-compiled ")
    assert merged.count("| dynamic ") == section.count("| dynamic ")


def test_the_torch_store_variant_stores_with_index_copy_where_cuda_would_launch_triton(monkeypatch):
    """ "paged+torch-store" runs with HF_PAGED_ATTENTION_BACKEND=torch, so a CUDA pool's store takes `index_copy_`
    instead of the Triton launch; the environment is put back after it, and other variants leave it alone."""
    import torch

    from bench.generate_speed import _backend
    from hf_paged.attention import store_backend
    from hf_paged.attention.kernels import BACKEND_ENV_VAR

    cuda = torch.device("cuda")
    monkeypatch.setenv(BACKEND_ENV_VAR, "auto")
    with _backend("paged+torch-store"):
        assert store_backend(cuda) == "torch"
    assert os.environ[BACKEND_ENV_VAR] == "auto"
    monkeypatch.delenv(BACKEND_ENV_VAR)
    with _backend("paged+torch-store"):
        assert os.environ[BACKEND_ENV_VAR] == "torch"
    with _backend("paged"):
        assert BACKEND_ENV_VAR not in os.environ
    assert BACKEND_ENV_VAR not in os.environ


def test_host_time_is_counted_where_the_innermost_package_defines_it():
    """A package installed under a directory named after another (triton in /opt/torch/.venv) is its own group."""
    from bench.generate_speed import _host_group

    site = "/opt/torch/.venv/lib/python3.12/site-packages"
    assert _host_group(f"{site}/triton/runtime/jit.py") == "triton"
    assert _host_group(f"{site}/torch/nn/modules/module.py") == "torch"
    assert _host_group(f"{site}/transformers/models/llama/modeling_llama.py") == "transformers"
    assert _host_group("/work/main/hf_paged/cache/update_path.py") == "hf_paged"
    assert _host_group("/usr/lib/python3.12/contextlib.py") == "other"
    assert _host_group("~") == "builtin"
