"""bench/engine_speed.py as a dry run on CPU: a 2-layer model, the Engine and both transformers baselines."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_serves_the_burst_with_every_backend_and_profiles_decode_steps(tmp_path, monkeypatch):
    out = tmp_path / "engine.json"
    argv = ["engine_speed.py", "--tiny", "--device", "cpu", "--num-requests", "6", "--prompt-lens", "8", "24"]
    argv += ["--output-lens", "4", "12", "--kv-memory", "1MiB", "--max-num-seqs", "8"]
    argv += ["--max-num-batched-tokens", "64", "--profile-steps", "3", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(ROOT / "bench" / "engine_speed.py"), run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    # graphs need CUDA; without them the Engine admits every step
    assert set(runs) == {
        "engine",
        "engine-async",
        "engine-async-admit-every-step",
        "transformers-cb",
        "generate-static",
    }
    assert {runs[name]["max_waiting_steps"] for name in ("engine", "engine-async-admit-every-step")} == {0}
    tokens = {name: run["output_tokens"] for name, run in runs.items()}
    assert len(set(tokens.values())) == 1 and tokens["engine"] > 0  # every backend served the whole burst
    assert runs["engine-async"]["num_async_steps"] > 0 and runs["engine"]["num_async_steps"] == 0
    assert report["engine-async_vs_eager_identical"] == "6/6 (bfloat16)"
    profile = runs["engine"]["profile"]
    assert profile["steps"] == 3 and profile["mean_rows"] >= 2 and profile["wall_ms_per_step"] > 0
    assert runs["engine"]["runner"]["eager_steps"] > 0
    # the profiled steps' time and tokens are left out of the Engine's speed
    prefill = runs["engine"]["prefill_profile"]  # the steps from one that prefills beside decoding rows
    assert 1 <= prefill["prefill_steps"] <= prefill["steps"] <= prefill["prefill_steps"] + 1
    assert prefill["prefill_tokens"] > 0 and prefill["tokens"] > 0 and prefill["wall_ms_per_step"] > 0
    window = runs["engine"]["profile_window"]
    assert window["tokens"] == profile["tokens"] + prefill["tokens"] and profile["tokens"] >= 6
    assert window["seconds"] > 0
    assert runs["engine"]["timed_tokens"] == tokens["engine"] - window["tokens"]
    assert runs["engine"]["tok_per_s"] == runs["engine"]["timed_tokens"] / runs["engine"]["wall_s"]
    steps_s = sum(kind["seconds"] for kind in runs["engine"]["steps"].values())  # the steps timed outside the window
    assert steps_s <= runs["engine"]["wall_s"] < steps_s + window["seconds"]  # the window's time is not in wall_s
    steps = runs["engine"]["steps"]  # every step but the profiled ones, by kind
    assert steps["prefill"]["steps"] > 0 and steps["decode"]["steps"] > 0
    profiled = 3 + prefill["steps"]
    assert steps["prefill"]["steps"] + steps["decode"]["steps"] + profiled == runs["engine"]["num_steps"]
    assert profile["top_kernels"] == []  # on CPU no kernel has device time
    assert all(runs[name]["warm_up_s"] > 0 for name in ("engine", "engine-async"))  # a burst of its own first

    from bench.gpu_report import _engine_section

    section = _engine_section(tmp_path)
    assert "transformers-cb" in section and f"{steps['prefill']['steps']} x " in section
    assert f"({prefill['prefill_steps']}/{prefill['steps']} prefill)" in section
