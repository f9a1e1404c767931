"""bench/gpu_report.py's running of steps on a lent GPU's clock: timeouts, the deadline, and the bundle."""

import json
import sys
import tarfile
import time

from bench import gpu_report
from bench.gpu_report import TIMEOUT_EXIT, Step, bundle, run_all


def _step(name: str, code: str) -> Step:
    return Step("tests", name, [sys.executable, "-c", code])


def test_a_step_past_its_timeout_is_stopped_and_none_starts_after_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_report, "MIN_STEP_SECONDS", 0.5)
    steps = [
        _step("quick", "print('done')"),
        _step("fails", "raise SystemExit(3)"),
        _step("slow", "import time; time.sleep(60)"),
        _step("late", "print('never')"),
    ]
    start = time.perf_counter()
    run_all(steps, tmp_path, deadline=30.0, step_timeout=2.0)
    assert time.perf_counter() - start < 20  # the slow step was stopped at its timeout, not waited for
    quick, fails, slow, late = steps
    assert (quick.returncode, quick.status, quick.output_tail) == (0, "ok", "done")
    assert fails.status == "FAILED (3)"
    assert slow.timed_out and slow.returncode == TIMEOUT_EXIT and slow.status.startswith("TIMED OUT after")
    assert late.status == "ok"  # the deadline had not passed

    # A step whose own child outlives it: the timeout stops the child too (a serving step's servers).
    marker = tmp_path / "child_alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w').close()"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    stale = tmp_path / "late.json"  # what an earlier run of the late step left
    stale.write_text("{}")
    steps = [_step("slow", parent), Step("tests", "late", [sys.executable, "-c", "print('never')"], outputs=[stale])]
    run_all(steps, tmp_path, deadline=1.5, step_timeout=None)
    assert steps[0].timed_out  # cut at the deadline
    assert steps[1].returncode is None and steps[1].status == "not run (deadline)"
    assert not stale.exists()  # not reported as this run's
    assert (tmp_path / "quick.log").read_text() == "done\n"
    time.sleep(3)
    assert not marker.exists()


def test_the_bundle_holds_every_raw_file_but_the_report(tmp_path):
    out = tmp_path / "gpu"
    out.mkdir()
    for name in ("REPORT.md", "engine.json", "generate_speed.log"):
        (out / name).write_text(name)
    bundle(out, tmp_path / "back" / "raw.tar.gz")
    with tarfile.open(tmp_path / "back" / "raw.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["engine.json", "generate_speed.log"]
        assert archive.extractfile("engine.json").read() == b"engine.json"


def test_the_plan_runs_what_the_floors_read_first_and_compiled_generate_apart_at_batch_1(tmp_path):
    steps = gpu_report.plan(tmp_path, set())
    kinds = [step.kind for step in steps]
    assert set(kinds) == set(gpu_report.STEP_KINDS)
    # tests, the Engine, the bf16 decode and prefill kernels, generate() compiled, the prefill kernel's tuning, a
    # layer's costs, the decode split counts and eager generate(); then fp32 decode, the decode kernel's tuning and
    # serving, which no floor reads.
    order = [
        "tests",
        "engine",
        "decode bf16 head_dim 64",
        "decode bf16 head_dim 128",
        "decode bf16 head_dim 256",
        "prefill bf16 head_dim 64",
        "prefill bf16 head_dim 128",
        "generate speed, compiled",
        "generate speed, compiled paged kernel",
        "prefill kernel tuning",
        "layer costs",
        "decode split counts",
        "generate speed",
        "decode fp32 head_dim 128",
        "decode kernel tuning",
        "serving",
    ]
    ranks = [next(i for i, name in enumerate(order) if name in (step.name, step.kind)) for step in steps]
    assert ranks == sorted(ranks) and set(ranks) == set(range(len(order)))
    compiled = [step for step in steps if step.name.startswith("generate speed, compiled")]
    assert len(compiled) == 2 and all(step.command[step.command.index("--batch") + 1] == "1" for step in compiled)
    assert all(step.outputs and step.outputs[0].parent == tmp_path for step in steps if step.kind != "tests")
    decode = [step for step in steps if step.name.startswith("decode bf16")]
    assert all(step.command[step.command.index("--table-tokens") + 1] == "32768" for step in decode)
    # the documented first command (docs/benchmarks.md, "GPU"): the split counts after the bf16 decode runs
    first = [
        step.name
        for step in gpu_report.plan(tmp_path, {"serving", "tuning", "generate", "compiled", "layers", "prefill"})
    ]
    assert first.index("decode split counts") == first.index("decode bf16 head_dim 256") + 1
    assert [step.kind for step in gpu_report.plan(tmp_path, {"tests", "serving"})][0] == "engine"
    # "generate" and "compiled" are skipped apart
    assert {step.kind for step in gpu_report.plan(tmp_path, {"generate"}) if "generate" in step.name} == {"compiled"}
    assert {step.kind for step in gpu_report.plan(tmp_path, {"compiled"}) if "generate" in step.name} == {"generate"}


def test_a_run_writes_the_report_and_brings_back_the_raw_results_in_one_archive(tmp_path, monkeypatch):
    """`main` end to end with stand-in steps (the real ones need a GPU): each step's output and log, REPORT.md with
    every step's status, the archive with the rest, and exit 1 as one step failed."""
    out, archive = tmp_path / "gpu", tmp_path / "back" / "raw.tar.gz"

    def plan(out, skip, engine_backends):
        writes = f"open({str(out / 'engine.json')!r}, 'w').write('{{}}')"
        return [
            Step("engine", "engine speed", [sys.executable, "-c", writes], outputs=[out / "engine.json"]),
            _step("generate speed", "raise SystemExit(2)"),
        ]

    monkeypatch.setattr(gpu_report, "plan", plan)
    monkeypatch.setattr(gpu_report.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_report.torch.cuda, "get_device_name", lambda *args: "Stand-in GPU")
    monkeypatch.setattr(gpu_report.torch.cuda, "get_device_capability", lambda *args: (9, 0))
    monkeypatch.setattr(gpu_report, "_engine_section", lambda out: "engine section\n")
    argv = ["--out", str(out), "--deadline", "60", "--step-timeout", "30", "--bundle", str(archive)]
    assert gpu_report.main(argv) == 1
    text = (out / "REPORT.md").read_text()
    assert "Stand-in GPU" in text and "| engine speed " in text and "FAILED (2)" in text
    with tarfile.open(archive) as bundled:
        assert sorted(bundled.getnames()) == ["engine.json", "engine_speed.log", "generate_speed.log"]


def test_the_gpu_tests_compile_their_kernels_in_parallel_where_xdist_is_installed(tmp_path, monkeypatch):
    """On a fresh machine every Triton variant compiles at its first launch: pytest-xdist's workers, when the
    machine has it, compile them in parallel; without it the tests run in one process."""
    installed = {"xdist": True}
    find_spec = gpu_report.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_report.importlib.util,
        "find_spec",
        lambda name, *args, **kwargs: (
            (object() if installed["xdist"] else None) if name == "xdist" else find_spec(name, *args, **kwargs)
        ),
    )
    monkeypatch.setattr(gpu_report, "available_cpus", lambda: 16)
    assert gpu_report.test_workers(16) == ["-n", str(gpu_report.MAX_TEST_WORKERS)]
    assert gpu_report.test_workers(2) == ["-n", "2"]
    (tests,) = [step for step in gpu_report.plan(tmp_path, set()) if step.kind == "tests"]
    assert tests.command[tests.command.index("-n") + 1] == str(gpu_report.MAX_TEST_WORKERS)
    assert tests.command.index("-n") < tests.command.index("tests/test_gpu.py")
    assert tests.env == {"OMP_NUM_THREADS": str(16 // gpu_report.MAX_TEST_WORKERS)}  # the cores shared out
    installed["xdist"] = False
    assert gpu_report.test_workers(16) == []
    (tests,) = [step for step in gpu_report.plan(tmp_path, set()) if step.kind == "tests"]
    assert "-n" not in tests.command and tests.env == {}


def test_a_step_runs_with_its_own_environment_over_the_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_REPORT_PROBE", "report")
    code = "import os; print(os.environ['HF_PAGED_REPORT_PROBE'], os.environ['HF_PAGED_STEP_PROBE'])"
    step = Step("tests", "env", [sys.executable, "-c", code], env={"HF_PAGED_STEP_PROBE": "step"})
    run_all([step], tmp_path, deadline=None, step_timeout=30.0)
    assert step.status == "ok" and step.output_tail == "report step"


def test_the_engine_section_shows_step_kinds_and_the_kernels_of_a_profiled_decode_step(tmp_path):
    profile = dict(steps=30, mean_rows=41.0, wall_ms_per_step=4.0, cuda_ms_per_step=3.0, gpu_busy=0.75)
    profile["top_kernels"] = [dict(name="_paged_decode_kernel", calls_per_step=16.0, us_per_step=410.0)]
    steps = {
        "decode": dict(steps=400, seconds=2.0, ms_per_step=5.0),
        "prefill": dict(steps=60, seconds=3.0, ms_per_step=50.0),
    }
    run = dict(tok_per_s=3000.0, profile=profile, steps=steps)
    args = dict(dtype="bfloat16", num_requests=128, prompt_lens=[128, 1024], output_lens=[64, 256], kv_memory="1GiB")
    report = dict(
        args=args, device="GPU", versions={}, runs={"engine-async": run, "transformers-cb": dict(tok_per_s=300.0)}
    )
    (tmp_path / "engine.json").write_text(json.dumps(report))
    section = gpu_report._engine_section(tmp_path)
    assert "| 10.00x" in section and "400 x 5.00 ms" in section and "60 x 50.00 ms" in section and "75%" in section
    assert "CUDA kernels of a profiled decode step, engine-async" in section
    assert "| _paged_decode_kernel | 16.0" in section and "| 410 " in section


def test_the_generate_section_shows_each_variants_kernel_time_at_the_profiled_batch():
    def profile(kernel_us: float, kernels: list[dict]) -> dict:
        top = [dict(operator="aten::mm", calls_per_token=113.0, us_per_token=2700.0)]
        runtime = {"cudaLaunchKernel": dict(calls_per_token=545.0, us_per_token=3700.0)}
        return dict(
            aten_calls_per_token=2437.0,
            aten_us_per_token=12000.0,
            runtime=runtime,
            top=top,
            kernel_us_per_token=kernel_us,
            kernels=kernels,
        )

    decode = [dict(kernel="_paged_decode_kernel", calls_per_token=16.0, us_per_token=3120.0)]
    ops = {"dynamic": profile(900.0, [dict(kernel="gemv", calls_per_token=113.0, us_per_token=700.0)])}
    ops["paged+hf_paged"] = profile(4100.0, decode)
    section = gpu_report._op_profile_tables(ops, 16)
    assert "Operators under torch.profiler, batch 16" in section
    assert "GPU kernel time per new token, batch 16" in section
    words = " ".join(section.split())  # the tables' cells without their padding
    assert "| paged+hf_paged | 4100 |" in words and "| dynamic | 900 |" in words
    assert "Most GPU time among kernels, paged+hf_paged" in words
    assert "| _paged_decode_kernel | 16.0 | 3120 |" in words


def test_the_engine_step_runs_the_backends_it_is_given(tmp_path):
    (engine,) = [step for step in gpu_report.plan(tmp_path, set()) if step.kind == "engine"]
    assert "--backends" not in engine.command  # all of them
    chosen = ["engine", "engine-async", "transformers-cb"]
    (engine,) = [step for step in gpu_report.plan(tmp_path, set(), chosen) if step.kind == "engine"]
    assert engine.command[engine.command.index("--backends") + 1 :] == chosen
