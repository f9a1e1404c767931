"""`python -m bench.gpu_report` (`make bench-gpu`): everything that needs a CUDA GPU, in one run and one report.

1. the GPU tests: tests/test_gpu.py (the paged path end to end on CUDA models) and tests/test_kernels.py /
   tests/test_prefill_kernel.py / tests/test_kernel_dispatch.py on CUDA tensors (the Triton kernels against their
   reference on the GPU);
2. bench/engine_speed.py: the Engine on a Llama-3.2-1B-shaped bf16 model, a burst of 128 requests (prompts
   128-1024, outputs 64-256) at 1 GiB of K/V, with and without CUDA graphs and asynchronous scheduling, beside
   transformers' continuous batching and static generate() batches; GPU busy share of its decode steps
   (torch.profiler); graph and asynchronous tokens against eager ones in float32;
3. bench/generate_speed.py: plain generate() on the same model (1024-token prompt, 128 new tokens, batch 1 and 16)
   with DynamicCache, PagedCache (sdpa and "hf_paged"), and compiled StaticCache and PagedCache(max_cache_len),
   milliseconds per new token, each one's tokens against DynamicCache's in float32, and a bf16 trace of every
   step's logits against DynamicCache's;
4. bench/decode_attention.py: the Triton decode kernel's fraction of HBM peak against gather + SDPA and SDPA on
   contiguous K/V, in bfloat16 (head_dim 64, 128, 256) and float32 (head_dim 128), and with block tables 32k tokens
   wide at the shorter contexts (CUDA graphs' and compiled caches' tables);
5. bench/prefill_attention.py: the Triton prefill kernel's TFLOP/s against SDPA on contiguous K/V (whole prompts of
   2k-8k tokens and chunks over a cached prefix), bf16, head_dim 64 and 128;
6. bench/decode_tuning.py and bench/prefill_tuning.py: the decode and prefill kernels' tiles, warps and stages tried
   beside their defaults (head_dim 64, 128 and 256; 64 and 128), the numbers their launch choices are made from;
7. the serving harness, `python -m bench --quick`, in float32 and bfloat16;
8. bench/layer_costs.py: one decoder layer's cache update and attention on a decode step (DynamicCache, PagedCache
   with sdpa and with "hf_paged") and the operations they are made of, host and GPU microseconds, batch 1 and 16.

They run in another order: what the issues' floors read first (1, 2, 4 and 5 in bf16, 3 compiled, whose floors no
run has measured yet, 6 for the prefill kernel, the furthest from its floor, then 8, under a minute, the decode
kernel's split-K counts on the Engine's ragged rows (`bench.decode_splits`, under a minute) and 3 eager, which writes
its timings before its profiles), then 4 in fp32, 6 for the decode kernel and 7, so a run cut short by its deadline
loses the least. Each step runs in its own process and the
report records its command, exit status and time, so one failing step does not hide the others. Writes
bench/results/gpu/REPORT.md (and the raw JSON and logs beside it); exits 1 when a step failed. Without CUDA it runs
nothing, says so, and exits 2.

On a lent GPU the time is counted: `--deadline` stops starting steps once that many seconds have passed (each step's
timeout is cut to what is left, and `--step-timeout` caps every step), and the report says which steps timed out or
were not run; `--bundle` packs the raw results into one archive, so REPORT.md and the archive are the only two files
to bring back.

    python -m bench.gpu_report                 # everything
    python -m bench.gpu_report --skip serving  # tests and decode only
    python -m bench.gpu_report --skip serving --deadline 510 --out /tmp/gpu --bundle "$OUT/raw.tar.gz"
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "gpu"
NO_CUDA_EXIT = 2
# What --skip names: "generate" is eager generate(), "compiled" generate() compiled (StaticCache and PagedCache).
STEP_KINDS = ("tests", "engine", "generate", "compiled", "layers", "decode", "prefill", "tuning", "serving")
DECODE_RUNS = [("bf16", 64), ("bf16", 128), ("bf16", 256), ("fp32", 128)]
PREFILL_RUNS = [("bf16", 64), ("bf16", 128)]
# The decode runs also time the kernel with block tables this wide at the shorter contexts: as CUDA graphs' tables
# (the Engine's) and a `max_cache_len` cache's are, whose split-K chunks are cut from each row's own length.
DECODE_TABLE_TOKENS = 32768
SERVING_DTYPES = ("float32", "bfloat16")


@dataclass
class Step:
    kind: str
    name: str
    command: list[str]
    returncode: int | None = None  # None: not run (the deadline had passed)
    seconds: float | None = None
    output_tail: str = ""
    timed_out: bool = False
    outputs: list[Path] = field(default_factory=list)  # the files it writes (a run's old ones go first)
    env: dict[str, str] = field(default_factory=dict)  # set for its process, over the report's own environment

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "not run (deadline)"
        if self.timed_out:
            return f"TIMED OUT after {self.seconds:.0f} s"
        return "ok" if self.returncode == 0 else f"FAILED ({self.returncode})"


def plan(out: Path, skip: set[str], engine_backends: list[str] | None = None) -> list[Step]:
    """The steps to run, in order, but those of the kinds in `skip`; `engine_backends`: the Engine step's backends
    (`engine_speed.py --backends`; all of them when None)."""
    python = sys.executable
    runs: dict[str, list[Step]] = {kind: [] for kind in STEP_KINDS}
    if "tests" not in skip:
        tests = ["tests/test_gpu.py", "tests/test_kernels.py", "tests/test_prefill_kernel.py"]
        tests.append("tests/test_kernel_dispatch.py")
        workers = test_workers()
        # Workers' torch threads share the machine's cores (the CPU references run in each worker).
        env = {"OMP_NUM_THREADS": str(max(1, available_cpus() // int(workers[1])))} if workers else {}
        command = [python, "-m", "pytest", "-q", "-rs", *workers, *tests]
        runs["tests"].append(Step("tests", "GPU tests", command, env=env))
    if "engine" not in skip:
        command = [python, "bench/engine_speed.py", "--json", str(out / "engine.json")]
        if engine_backends:
            command += ["--backends", *engine_backends]
        runs["engine"].append(Step("engine", "engine speed", command, outputs=[out / "engine.json"]))
    for name, (label, arguments) in GENERATE_RUNS.items():
        kind = "compiled" if "compiled" in label else "generate"
        if kind not in skip:
            command = [python, "bench/generate_speed.py", *arguments, "--json", str(out / name)]
            runs[kind].append(Step(kind, label, command, outputs=[out / name]))
    if "layers" not in skip:
        command = [python, "-m", "bench.layer_costs", "--json", str(out / "layer_costs.json")]
        runs["layers"].append(Step("layers", "layer costs", command, outputs=[out / "layer_costs.json"]))
    if "decode" not in skip:
        for dtype, head_dim in DECODE_RUNS:
            json_path = out / f"decode_{dtype}_d{head_dim}.json"
            command = [python, "bench/decode_attention.py", "--dtype", dtype, "--head-dim", str(head_dim)]
            command += ["--table-tokens", str(DECODE_TABLE_TOKENS)]
            name, command = f"decode {dtype} head_dim {head_dim}", [*command, "--json", str(json_path)]
            runs["decode"].append(Step("decode", name, command, outputs=[json_path]))
        command = [python, "-m", "bench.decode_splits", "--json", str(out / "decode_splits.json")]
        runs["decode"].append(Step("decode", "decode split counts", command, outputs=[out / "decode_splits.json"]))
    if "prefill" not in skip:
        for dtype, head_dim in PREFILL_RUNS:
            json_path = out / f"prefill_{dtype}_d{head_dim}.json"
            command = [python, "-m", "bench.prefill_attention", "--dtype", dtype, "--head-dim", str(head_dim)]
            name, command = f"prefill {dtype} head_dim {head_dim}", [*command, "--json", str(json_path)]
            runs["prefill"].append(Step("prefill", name, command, outputs=[json_path]))
    if "tuning" not in skip:
        command = [python, "-m", "bench.decode_tuning", "--json", str(out / "decode_tuning.json")]
        runs["tuning"].append(Step("tuning", "decode kernel tuning", command, outputs=[out / "decode_tuning.json"]))
        command = [python, "-m", "bench.prefill_tuning", "--json", str(out / "prefill_tuning.json")]
        outputs = [out / "prefill_tuning.json"]
        runs["tuning"].append(Step("tuning", "prefill kernel tuning", command, outputs=outputs))
    if "serving" not in skip:
        for dtype in SERVING_DTYPES:
            command = [python, "-m", "bench", "--quick", "--device", "cuda", "--dtype", dtype, "--no-progress"]
            command += ["--log", str(out / f"SERVING_{dtype}.md"), "--json", str(out / f"cache_report_{dtype}.json")]
            command += ["--serving-json", str(out / f"serving_{dtype}.json")]
            outputs = [out / f"SERVING_{dtype}.md", out / f"cache_report_{dtype}.json", out / f"serving_{dtype}.json"]
            runs["serving"].append(Step("serving", f"serving {dtype}", command, outputs=outputs))
    # The order they run in: what every issue's floors read first (the Engine, the bf16 kernels, generate() compiled,
    # whose floors no run has measured yet, the prefill kernel's tuning, as that kernel is the furthest from its
    # floor, a layer's costs, under a minute, then eager generate(), which saves its timings before its profiles),
    # then what no floor reads (fp32 decode, the decode kernel's tuning, serving), so a run cut short by its deadline
    # loses the least. The decode split counts (under a minute: the Engine's decode steps are the rows they time) follow
    # the bf16 decode runs in a run that skips the others, and the layer costs in a whole run.
    decode_bf16 = [step for step in runs["decode"] if " bf16 " in step.name]
    splits = [step for step in runs["decode"] if step.name == "decode split counts"]
    prefill_tuning = [step for step in runs["tuning"] if step.name.startswith("prefill")]
    return [
        *runs["tests"],
        *runs["engine"],
        *decode_bf16,
        *runs["prefill"],
        *runs["compiled"],
        *prefill_tuning,
        *runs["layers"],
        *splits,
        *runs["generate"],
        *[step for step in runs["decode"] if step not in decode_bf16 + splits],
        *[step for step in runs["tuning"] if step not in prefill_tuning],
        *runs["serving"],
    ]


def test_workers(cpu_count: int | None = None) -> list[str]:
    """pytest-xdist's `-n` for the GPU tests where it is installed (the lent GPU's machine has it), [] where not.

    Why: a fresh machine's Triton cache is empty, and the kernel tests launch some hundred kernel variants, each
    compiled on the CPU at its first launch (LLVM and ptxas, seconds each); compiled in turn they would take much of
    the step's timeout. Workers compile in parallel on the machine's cores and share the GPU."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(MAX_TEST_WORKERS, cpu_count or available_cpus())))]


def available_cpus() -> int:
    """The cores this process may run on (its affinity where the platform says, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


MAX_TEST_WORKERS = 8  # of the lent machine's 16 cores: each worker holds a CUDA context and compiles on one core
TIMEOUT_EXIT = 124  # what `timeout` exits with
MIN_STEP_SECONDS = 5  # a step is not started with less time than this left before the deadline


def run(step: Step, out: Path, timeout: float | None = None) -> None:
    """Run `step` in its own process, its output to a log in `out`; killed after `timeout` seconds."""
    print(f"== {step.name}: {' '.join(step.command)}", flush=True)
    start = time.perf_counter()
    log = out / f"{step.name.replace(' ', '_')}.log"
    with open(log, "w") as f:
        # A session of its own, so that a timeout stops what the step started too (the serving harness's servers).
        env = {**os.environ, **step.env}
        process = subprocess.Popen(
            step.command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            step.returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the group may have ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            step.returncode, step.timed_out = TIMEOUT_EXIT, True
    step.seconds = time.perf_counter() - start
    step.output_tail = "\n".join(log.read_text().splitlines()[-25:])
    print(f"   {step.status}" + ("" if step.timed_out else f" in {step.seconds:.0f} s") + f" (log: {log})", flush=True)


def run_all(steps: list[Step], out: Path, deadline: float | None, step_timeout: float | None) -> None:
    """Run `steps` in order; none starts once `deadline` seconds have passed, and each is killed at the deadline or
    after `step_timeout` seconds, whichever comes first."""
    for step in steps:  # no result of an earlier run is reported as this one's
        for path in step.outputs:
            path.unlink(missing_ok=True)
    start = time.perf_counter()
    for step in steps:
        left = None if deadline is None else deadline - (time.perf_counter() - start)
        if left is not None and left < MIN_STEP_SECONDS:
            print(f"== {step.name}: not run, the deadline of {deadline:.0f} s has passed", flush=True)
            continue
        limits = [limit for limit in (left, step_timeout) if limit is not None]
        run(step, out, min(limits) if limits else None)


def bundle(out: Path, path: Path) -> None:
    """Every file of `out` but REPORT.md in one gzipped tar at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for file in sorted(out.iterdir()):
            if file.is_file() and file.name != "REPORT.md" and file.resolve() != path.resolve():
                archive.add(file, arcname=file.name)


def _decode_section(out: Path) -> str:
    parts = []
    for dtype, head_dim in DECODE_RUNS:
        path = out / f"decode_{dtype}_d{head_dim}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        args = report["args"]
        peak = report["peak_bandwidth"]
        peak_text = f"{peak / 1e12:.2f} TB/s" if peak else "unknown"
        parts.append(
            f"### {args['dtype']}, head_dim {args['head_dim']}, {args['num_q_heads']} q / {args['num_kv_heads']} kv "
            f"heads, block_size {args['block_size']}\n\n{report['device']}, HBM peak {peak_text}\n"
        )
        rows = [
            [
                r["batch"],
                r["context"],
                r["method"],
                r.get("skipped") or f"{r['ms'] * 1e3:.1f}",
                f"{r['graph_ms'] * 1e3:.1f}" if r.get("graph_ms") is not None else "",
                f"{r['bandwidth_gbs']:.0f}" if "ms" in r else "",
                f"{r['peak_fraction']:.0%}" if r.get("peak_fraction") is not None else "",
                r.get("num_splits", ""),
            ]
            for r in report["results"]
        ]
        headers = [
            "batch",
            "context",
            "method",
            "time (us)",
            "under a CUDA graph (us)",
            "GB/s",
            "% of HBM peak",
            "splits",
        ]
        parts.append(tabulate(rows, headers, tablefmt="github", disable_numparse=True) + "\n")
    return "\n".join(parts) if parts else "(no decode results)\n"


def _prefill_section(out: Path) -> str:
    parts = []
    for dtype, head_dim in PREFILL_RUNS:
        path = out / f"prefill_{dtype}_d{head_dim}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        args = report["args"]
        parts.append(
            f"### {args['dtype']}, head_dim {args['head_dim']}, {args['num_q_heads']} q / {args['num_kv_heads']} kv "
            f"heads, block_size {args['block_size']}\n\n{report['device']}\n"
        )
        rows = [
            [
                r["batch"],
                r["new"],
                r["cached"],
                r["method"],
                r.get("skipped") or f"{r['ms'] * 1e3:.0f}",
                f"{r['tflops']:.0f}" if "ms" in r else "",
                f"{r['speed_vs_sdpa']:.2f}x" if "speed_vs_sdpa" in r else "",
                f"{r['max_abs_err_vs_sdpa']:.1e}" if "max_abs_err_vs_sdpa" in r else "",
            ]
            for r in report["results"]
        ]
        headers = ["batch", "new", "cached", "method", "time (us)", "TFLOP/s", "vs SDPA", "max |err|"]
        parts.append(tabulate(rows, headers, tablefmt="github", disable_numparse=True) + "\n")
    return "\n".join(parts) if parts else "(no prefill results)\n"


# json file -> (step, its arguments). The eager step profiles at batch 16, where "hf_paged" lost most on the H200
# (bench/logs/gpu-h200-9849b1a; its batch-1 profiles are there), and leaves out "paged+contiguous-kv" (contiguous
# copies for SDPA were slower than the view there, and the bf16 trace was identical without them: its run of the
# trace stays). Compiled variants run apart and at batch 1 only (their floors' batch): each
# compiles the 1B model's forward once per dtype, a minute or so, and a timeout there leaves the eager numbers.
GENERATE_RUNS = {
    "generate.json": (
        "generate speed",
        [
            "--variants",
            "dynamic",
            "paged",
            "paged+hf_paged",
            "paged+torch-store",
            "--host-profile",
            "32",
            "--profile-batch",
            "16",
        ],
    ),
    "generate_compiled.json": (
        "generate speed, compiled",
        ["--variants", "dynamic", "static-compiled", "paged-compiled", "--batch", "1", "--trace-steps", "0"],
    ),
    "generate_compiled_kernel.json": (
        "generate speed, compiled paged kernel",
        ["--variants", "dynamic", "paged+hf_paged-compiled", "--batch", "1", "--trace-steps", "0"],
    ),
}


def _generate_section(out: Path) -> str:
    reports = [json.loads((out / name).read_text()) for name in GENERATE_RUNS if (out / name).exists()]
    if not reports:
        return "(no generate results)\n"
    args = reports[0]["args"]
    parts = [
        f"{reports[0]['device']}, {args['dtype']}, prompt {args['prompt_len']}, {args['new_tokens']} new tokens, "
        f"greedy; {reports[0]['versions']}\n"
    ]
    rows, identity, trace, host, ops = [], [], None, None, None
    for report in reports:  # each step's speeds against the DynamicCache runs of that step
        dynamic, dynamic_decode = {}, {}
        for r in report["speed"]:  # DynamicCache's best time is the reference (a row of each batch, or more)
            if r["variant"] == "dynamic":
                dynamic[r["batch"]] = min(dynamic.get(r["batch"], r["ms_per_token"]), r["ms_per_token"])
                if r.get("decode_ms_per_token") is not None:
                    decode = r["decode_ms_per_token"]
                    dynamic_decode[r["batch"]] = min(dynamic_decode.get(r["batch"], decode), decode)
        for r in report["speed"]:
            if r["variant"] == "dynamic" and report is not reports[0]:
                continue  # DynamicCache's rows once, from the first step
            speed = dynamic[r["batch"]] / r["ms_per_token"] if r["batch"] in dynamic else None
            decode = r.get("decode_ms_per_token")  # None in reports from before the prompt was timed alone
            reference = dynamic_decode.get(r["batch"])
            decode_speed = reference / decode if decode and reference is not None else None
            rows.append(
                [
                    r["batch"],
                    r["variant"],
                    f"{r['ms_per_token']:.2f}",
                    "" if speed is None else f"{speed:.2f}x",
                    "" if decode is None else f"{r['prompt_ms']:.1f}",
                    "" if decode is None else f"{decode:.2f}",
                    "" if decode_speed is None else f"{decode_speed:.2f}x",
                ]
            )
        identity += [r for r in report.get("identity") or [] if r["variant"] != "dynamic"]
        trace = trace or report.get("trace")
        host = host or report.get("host_profile")
        ops = ops or report.get("op_profile")
    headers = ["batch", "variant", "ms per new token", "speed vs DynamicCache", "prompt ms", "decode ms per token"]
    parts.append(tabulate(rows, [*headers, "decode speed vs DynamicCache"], tablefmt="github", disable_numparse=True))
    if trace:
        rows = [
            [
                v["variant"],
                v["differing_steps"][0] if v["differing_steps"] else "none",
                f"{len(v['differing_steps'])}/{trace['steps'] + 1}",
                f"{v['max_abs_diff']:.3g}",
                ", ".join(map(str, v["argmax_differs"])) or "none",
                "; ".join(v["sdpa"]),
            ]
            for v in trace["variants"]
        ]
        parts += [
            f"\nLogits against DynamicCache in {trace['dtype']}, batch 1, DynamicCache's tokens fed for "
            f"{trace['steps']} steps (step 0: the prompt's forward); DynamicCache's SDPA at layer 0: "
            f"{'; '.join(trace['dynamic_sdpa'])}\n",
            tabulate(
                rows,
                [
                    "variant",
                    "first step with other logits",
                    "steps differing",
                    "max abs diff",
                    "argmax differs at",
                    "SDPA at layer 0 (backend, K)",
                ],
                tablefmt="github",
            ),
        ]
    if identity:
        rows = [
            [r["batch"], r["variant"], f"{r['identical_rows']}/{r['rows']}", r["first_diff"] or ""] for r in identity
        ]
        parts += [
            f"\nTokens against DynamicCache in {args['check_dtype']} ({args['check_tokens']} new tokens):\n",
            tabulate(rows, ["batch", "variant", "identical rows", "first differing step"], tablefmt="github"),
        ]
    profile_batch = args.get("profile_batch", 1)
    if host:
        parts.append(_host_profile_tables(host, profile_batch))
    if ops:
        parts.append(_op_profile_tables(ops, profile_batch))
    return "\n".join(parts) + "\n"


def _host_profile_tables(host: dict, batch: int) -> str:
    """generate_speed's `--host-profile`: host ms per new token by where it is spent, then each variant's functions
    with the most own time."""
    groups = sorted({group for profile in host.values() for group in profile["ms_per_token_by_group"]})
    rows = [
        [variant, f"{p['ms_per_token']:.2f}", *(f"{p['ms_per_token_by_group'].get(g, 0.0):.2f}" for g in groups)]
        for variant, p in host.items()
    ]
    parts = [
        f"\nHost time under cProfile, batch {batch}, ms per new token, the prompt's forward included (own time of the "
        "functions defined there; `builtin`: C functions such as ATen calls and kernel launches, and the host's "
        "waits for the GPU):\n",
        tabulate(rows, ["variant", "generate()", *groups], tablefmt="github", disable_numparse=True),
    ]
    parts += _top_tables(host, "Most own host time", "function", "own_us_per_token")
    return "\n".join(parts)


def _op_profile_tables(ops: dict, batch: int) -> str:
    """generate_speed's operators under torch.profiler: per new token, each variant's ATen calls and every CUDA
    runtime call (count and own host time), then each variant's operators with the most own time, and on a GPU its
    kernel time and the kernels that take most of it."""
    calls = sorted({name for profile in ops.values() for name in profile["runtime"]})
    rows = [
        [
            variant,
            f"{p['aten_calls_per_token']:.0f} / {p['aten_us_per_token']:.0f}",
            *(
                f"{p['runtime'][name]['calls_per_token']:.1f} / {p['runtime'][name]['us_per_token']:.0f}"
                if name in p["runtime"]
                else ""
                for name in calls
            ),
        ]
        for variant, p in ops.items()
    ]
    parts = [
        f"\nOperators under torch.profiler, batch {batch}, per new token (calls / us of own host time; CUDA runtime "
        "calls on a GPU only):\n",
        tabulate(rows, ["variant", "ATen", *calls], tablefmt="github", disable_numparse=True),
    ]
    parts += _top_tables(ops, "Most own host time among ATen operators", "operator", "us_per_token")
    kernels = {variant: p for variant, p in ops.items() if p.get("kernels")}
    if kernels:
        rows = [[variant, f"{p['kernel_us_per_token']:.0f}"] for variant, p in kernels.items()]
        parts += [
            f"\nGPU kernel time per new token, batch {batch} (us, the prompt's forward included):\n",
            tabulate(rows, ["variant", "kernel us a token"], tablefmt="github", disable_numparse=True),
        ]
        profiles = {variant: dict(top=p["kernels"]) for variant, p in kernels.items()}
        parts += _top_tables(profiles, "Most GPU time among kernels", "kernel", "us_per_token")
    return "\n".join(parts)


def _top_tables(profiles: dict, heading: str, name: str, us_key: str) -> list[str]:
    """Each variant's costliest entries of `profiles` (its "top" list): `name` (the column and the entry's key), calls
    and host us a new token (`us_key`)."""
    parts = []
    for variant, profile in profiles.items():
        table = [[e[name], f"{e['calls_per_token']:.1f}", f"{e[us_key]:.0f}"] for e in profile["top"]]
        parts += [
            f"\n{heading}, {variant}:\n",
            tabulate(table, [name, "calls a token", "us a token"], tablefmt="github", disable_numparse=True),
        ]
    return parts


def _layers_section(out: Path) -> str:
    """bench/layer_costs.py: host and GPU microseconds of each layer path (per layer) and operation (per call)."""
    path = out / "layer_costs.json"
    if not path.exists():
        return "(no layer cost results)\n"
    report = json.loads(path.read_text())
    args = report["args"]
    rows = [
        [r["batch"], r["what"], f"{r['host_us']:.1f}", "" if r["gpu_us"] is None else f"{r['gpu_us']:.1f}"]
        for r in report["rows"]
    ]
    return (
        f"{report['device']}, context {args['context']}, {args['iters']} calls each; {report['versions']}\n\n"
        + tabulate(rows, ["batch", "per layer / per call", "host us", "GPU us"], tablefmt="github")
        + "\n"
    )


def _engine_section(out: Path) -> str:
    path = out / "engine.json"
    if not path.exists():
        return "(no engine results)\n"
    report = json.loads(path.read_text())
    args, runs = report["args"], report["runs"]
    peer = runs.get("transformers-cb", {}).get("tok_per_s")
    rows = []
    for name, run in runs.items():
        profile = run.get("profile") or {}
        prefill = run.get("prefill_profile") or {}
        steps = run.get("steps") or {}
        rows.append(
            [
                name,
                f"{run['tok_per_s']:.1f}",
                f"{run['tok_per_s'] / peer:.2f}x" if peer else "",
                f"{profile['wall_ms_per_step']:.2f} / {profile['cuda_ms_per_step']:.2f}" if profile else "",
                f"{profile['gpu_busy']:.0%}" if profile else "",
                f"{prefill['wall_ms_per_step']:.2f} / {prefill['cuda_ms_per_step']:.2f} "
                f"({prefill['prefill_steps']}/{prefill['steps']} prefill)"
                if prefill
                else "",
                *(
                    f"{steps[kind]['steps']} x {steps[kind]['ms_per_step']:.2f} ms" if kind in steps else ""
                    for kind in ("decode", "prefill")
                ),
                f"{run['warm_up_s']:.1f}" if "warm_up_s" in run else "",
            ]
        )
    headers = ["backend", "output tok/s", "vs transformers-cb", "decode step wall / CUDA ms (profiled)", "GPU busy"]
    headers += ["steps from one that prefills, wall / CUDA ms (profiled)"]
    headers += ["decode steps", "steps with prefill", "warm-up s (untimed)"]
    lines = [
        f"{report['device']}, {args['dtype']}, {args['num_requests']} requests (prompts {args['prompt_lens']}, "
        f"outputs {args['output_lens']}), {args['kv_memory']} of K/V; {report['versions']}\n",
        tabulate(rows, headers, tablefmt="github"),
    ]
    labels = (
        ("engine-graphs_vs_eager_identical", "graph vs eager tokens"),
        ("engine-async_vs_eager_identical", "graphs + async scheduling vs eager tokens"),
        ("engine-async-compiled_vs_async_identical", "compiled forwards vs engine-async tokens"),
        ("check", "in float32"),
    )
    for key, label in labels:
        if key in report:
            lines.append(f"\n{label}: {report[key]}")
    for name, run in runs.items():
        if run.get("decode_compile_error"):
            lines.append(
                f"\n{name}: its decode steps ran eagerly, their forward did not compile: {run['decode_compile_error']}"
            )
        if run.get("compile_error"):
            lines.append(
                f"\n{name}: its steps that prefill ran eagerly, their forward did not compile: {run['compile_error']}"
            )
        elif run.get("num_compiled_prefill_steps"):
            lines.append(
                f"\n{name}: {run['num_compiled_prefill_steps']} steps that prefill ran compiled (warm-up included)"
            )
    for key, what in (
        ("profile", "a profiled decode step"),
        ("prefill_profile", "the profiled steps from one that prefills"),
    ):
        for name, run in runs.items():  # where the profiled steps' CUDA time goes
            kernels = (run.get(key) or {}).get("top_kernels")
            if kernels:
                table = [[k["name"], f"{k['calls_per_step']:.1f}", f"{k['us_per_step']:.0f}"] for k in kernels]
                lines.append(f"\nCUDA kernels of {what}, {name}:\n")
                lines.append(
                    tabulate(table, ["kernel", "calls a step", "us a step"], tablefmt="github", disable_numparse=True)
                )
    graphs = (runs.get("engine-async") or runs.get("engine-graphs") or {}).get("runner")
    if graphs:
        seconds = sum(capture[2] for capture in graphs["captures"])
        lines.append(
            f"\nCUDA graphs: {len(graphs['captures'])} captured (bucket, width: "
            f"{', '.join(f'{b}x{w}' for b, w, _ in graphs['captures'])}) in {seconds:.1f} s, "
            f"{graphs['capture_bytes'] / 2**20:.0f} MiB; {graphs['replayed_steps']} steps replayed, "
            f"{graphs['eager_steps']} eager"
        )
    return "\n".join(lines) + "\n"


def _kernel_run_heading(title: str, report: dict, what: str) -> str:
    """A tuning run's heading: `title`, then the device, dtype, heads and block size of its `report`, and `what`."""
    args = report["args"]
    shapes = (
        f"{args['dtype']}, {args['num_q_heads']} q / {args['num_kv_heads']} kv heads, block_size {args['block_size']}"
    )
    return f"### {title}\n\n{report['device']}, {shapes}; {what}\n"


def _tuning_section(out: Path) -> str:
    from bench.decode_tuning import best_overall
    from bench.decode_tuning import table as tuning_table

    parts = []
    for kernel, name, timing in (
        ("decode", "decode_tuning.json", "replayed from a CUDA graph"),
        ("prefill", "prefill_tuning.json", "replayed from a CUDA graph (M: BLOCK_M rows, tokens x q heads)"),
    ):
        path = out / name
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        what = f"each configuration's time {timing} (N: BLOCK_N, w: warps, s: stages)"
        parts.append(_kernel_run_heading(f"{kernel} kernel", report, what))
        for result in report["results"]:
            overall = best_overall(result)
            parts += [f"#### {kernel}, head_dim {result['head_dim']}\n", tuning_table(result)]
            if overall is not None:
                parts.append(
                    f"\nBest over every cell: {overall[0]} ({overall[1]:.2f}x each cell's best, geometric mean)\n"
                )
    path = out / "decode_splits.json"
    if path.exists():
        from bench.decode_splits import table as splits_table

        report = json.loads(path.read_text())
        what = "rows of lengths drawn uniformly from each range, each split count's time replayed from a CUDA graph"
        parts.append(_kernel_run_heading("decode split counts", report, f"{what} (`python -m bench.decode_splits`)"))
        for result in report["results"]:
            parts += [
                f"#### split counts, head_dim {result['head_dim']}\n",
                splits_table(result, report["peak_bandwidth"]),
            ]
    return "\n".join(parts) + "\n" if parts else "(no tuning results)\n"


def _serving_section(out: Path) -> str:
    parts = []
    for dtype in SERVING_DTYPES:
        path = out / f"SERVING_{dtype}.md"
        if path.exists():  # the harness's own report, its headings one level down
            text = "\n".join("#" + line if line.startswith("#") else line for line in path.read_text().splitlines())
            parts.append(f"### serving, {dtype} ({path.name})\n\n{text}\n")
    return "\n".join(parts) if parts else "(no serving results)\n"


def report(steps: list[Step], out: Path) -> str:
    import triton

    device = torch.cuda.get_device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    lines = [
        "# GPU report",
        "",
        f"{device} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}), torch "
        f"{torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}, commit "
        f"{commit.stdout.strip() or 'unknown'}, {time.strftime('%Y-%m-%d %H:%M')}. Static register and occupancy "
        "numbers for the same kernels: docs/kernels.md.",
        "",
        "## Steps",
        "",
        tabulate(
            [[s.name, s.status, "" if s.seconds is None else f"{s.seconds:.0f}"] for s in steps],
            ["step", "status", "seconds"],
            tablefmt="github",
        ),
        "",
    ]
    for step in steps:
        if step.returncode is not None and (step.kind == "tests" or step.returncode != 0):
            lines += [f"### {step.name}: `{' '.join(step.command)}`", "", "```", step.output_tail, "```", ""]
    lines += ["## Decode attention", "", _decode_section(out)]
    lines += ["## Prefill attention", "", _prefill_section(out)]
    lines += ["## Kernel launch choices", "", _tuning_section(out)]
    lines += ["## generate() per cache", "", _generate_section(out)]
    lines += ["## A decoder layer's cache and attention", "", _layers_section(out)]
    lines += ["## Engine", "", _engine_section(out)]
    lines += ["## Serving", "", _serving_section(out)]
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench.engine_speed import BACKENDS as engine_backends

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT), help="folder for REPORT.md and the raw results")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEP_KINDS, help="steps to leave out")
    parser.add_argument("--deadline", type=float, help="seconds after which no step starts (and a running one stops)")
    parser.add_argument("--step-timeout", type=float, help="seconds after which a step is stopped")
    parser.add_argument("--bundle", help="also pack the raw results (all but REPORT.md) into this .tar.gz")
    parser.add_argument(
        "--engine-backends",
        nargs="+",
        choices=engine_backends,
        help="the Engine step's backends (default: all; the baselines take most of its time, the compiled one's "
        "warm-up compiles)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"CUDA is not available: `make bench-gpu` runs only on a CUDA GPU; nothing was run (exit {NO_CUDA_EXIT})."
        )
        return NO_CUDA_EXIT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = plan(out, set(args.skip), args.engine_backends)
    run_all(steps, out, args.deadline, args.step_timeout)
    (out / "REPORT.md").write_text(report(steps, out))
    if args.bundle:
        bundle(out, Path(args.bundle))
    failed = [s.name for s in steps if s.returncode != 0]
    print(f"wrote {out / 'REPORT.md'}" + (f"; failed or not run: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
