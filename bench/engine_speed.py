"""`python bench/engine_speed.py`: the Engine on a GPU, with and without CUDA graphs, beside transformers' own
batching, at the same K/V memory.

Model: Llama-3.2-1B's shape with random weights (bench/models.py), bf16. Workload: a burst of `--num-requests`
requests at t=0, prompts uniform in `--prompt-lens`, outputs uniform in `--output-lens` (seeded). Every backend
gets `--kv-memory` of K/V:

    engine           Engine(max_num_seqs, max_num_batched_tokens, cuda_graphs=False, async_scheduling=False):
                     decode steps eager, every step's tokens read before the next is scheduled
    engine-graphs    the same with CUDA graphs (decode steps replayed per batch bucket)
    engine-async     CUDA graphs and asynchronous scheduling (the Engine's defaults on CUDA): a decode step is
                     launched before the tokens of the one before it are read; with graphs, admission waits up to
                     `GRAPH_MAX_WAITING_STEPS` decode-only steps (`max_waiting_steps`)
    engine-async-admit-every-step
                     the same with admission tried every step (`max_waiting_steps=0`, vLLM's way)
    engine-async-compiled
                     engine-async with its forwards compiled (`compile_decode=True`: inductor fuses each layer's small
                     operations before the graphs are captured; `compile_prefill=True`: the steps that prefill run
                     one compiled graph for every token count instead of an eager forward)
    transformers-cb  transformers' continuous batching (its manager, defaults, num_blocks matched)
    generate-static  generate() with DynamicCache in static batches as large as the memory holds

Each Engine first serves `hf_paged.engine.warm_up`'s burst (`warm_up_s`: Triton's and torch.compile's compiling, the
first graphs captured), then the timed one. For each: output tokens per second over the whole burst, and for the
Engine a profile of `--profile-steps` decode-only steps (once every request is past its prompt): wall and CUDA kernel
time per step (torch.profiler), so the GPU's busy share, and the same of the steps from the first that prefills
beside at least two decoding rows, up to `PREFILL_PROFILE_STEPS` that prefill one after the other. Those steps, and
the profiler's own starts and stops, are left out of the Engine's tokens per second (its time and its tokens). Then
the graph run's and the asynchronous run's tokens against the eager run's, in float32 (`--check-dtype`), on the
first `--check-requests` requests.

On CPU, `--tiny` runs the Engine parts on a 2-layer model (a dry run; graphs need CUDA).

    python bench/engine_speed.py --json bench/results/gpu/engine.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.host import device_name, versions  # noqa: E402
from bench.models import LLAMA_1B_SHAPE, TINY_SHAPE, llama_shaped  # noqa: E402
from bench.runs import Budget  # noqa: E402
from bench.workloads import burst  # noqa: E402
from hf_paged import BlockPool, Engine  # noqa: E402
from hf_paged.engine.warm_up import warm_up as engine_warm_up  # noqa: E402
from hf_paged.storage.pool import parse_memory  # noqa: E402

# In the order they run: what a deadline cuts short is the last ones (the float32 token check runs before the
# compiled backend, whose warm-up compiles).
BACKENDS = (
    "engine",
    "engine-graphs",
    "engine-async",
    "engine-async-compiled",
    "transformers-cb",
    "engine-async-admit-every-step",
    "generate-static",
)
# Engine backends: (cuda_graphs, async_scheduling, max_waiting_steps: None for the Engine's default, compile: the
# decode and prefill forwards compiled)
ENGINE_MODES = {
    "engine": (False, False, None, False),
    "engine-graphs": (True, False, None, False),
    "engine-async": (True, True, None, False),
    "engine-async-admit-every-step": (True, True, 0, False),
    "engine-async-compiled": (True, True, None, True),
}
CUDA_ONLY = ("engine-graphs", "engine-async-compiled")


def run_engine(
    model,
    workload,
    kv_bytes: int,
    args,
    *,
    cuda_graphs: bool,
    profile: bool,
    async_scheduling: bool = False,
    max_waiting_steps: int | None = None,
    compile: bool = False,
    warm_up: bool = False,
) -> dict:
    """`workload` through a fresh Engine (after `warm_up`: `hf_paged.engine.warm_up`'s burst, untimed)."""
    pool = BlockPool.for_model(model, max_memory=kv_bytes, block_size=16)
    engine = Engine(
        model,
        pool,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=cuda_graphs,
        async_scheduling=async_scheduling,
        max_waiting_steps=max_waiting_steps,
        compile_decode=compile,
        compile_prefill=compile,
    )
    warm_up_s = engine_warm_up(engine) if warm_up else 0.0  # it puts back the Engine's statistics
    request_ids = [
        engine.add_request(list(spec.prompt_ids), max_new_tokens=spec.max_new_tokens, ignore_eos=True)
        for spec in workload.requests
    ]
    cuda = pool.device.type == "cuda"
    step_profile = prefill_profile = None
    tries = 0  # windows profiled for prefill_profile

    def output_tokens() -> int:
        return sum(len(engine.request(r).output_ids) for r in request_ids)

    # Wall time of each kind of step, outside the profiler: "decode" (every running request adds one token, nothing
    # waits: the steps CUDA graphs replay) and "prefill" (a step that also prefills, run eagerly).
    step_seconds: dict[str, list[float]] = {"decode": [], "prefill": []}
    # The profiled steps, with the profiler's own start and stop (0.5-2 s on an H200), are left out of the timed run:
    # its wall time and the tokens its speed counts.
    window_s, window_tokens = 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        decode_only = not engine.num_waiting and all(r.num_pending == 1 for r in engine.scheduler.running)
        if profile and step_profile is None and decode_only and engine.num_running >= 2:
            if cuda:
                torch.cuda.synchronize()  # the steps before it finish inside the timed run
            window_start = time.perf_counter()
            step_profile = profile_steps(engine, args.profile_steps, cuda)
            window_s += time.perf_counter() - window_start
            window_tokens += step_profile["tokens"]
            continue
        # Rows decoding are counted last, once the rest holds: the loop's own host time is in the timed run.
        if (
            profile
            and prefill_profile is None
            and tries < PREFILL_PROFILE_TRIES
            and not decode_only
            and sum(r.num_pending == 1 for r in engine.scheduler.running) >= 2
        ):
            # The first steps from one that prefills beside decoding rows (as requests are admitted while others
            # decode), left out the same way.
            if cuda:
                torch.cuda.synchronize()
            window_start, tokens_before = time.perf_counter(), output_tokens()
            window = profile_steps(engine, PREFILL_PROFILE_STEPS, cuda, until_prefilled=PREFILL_PROFILE_STEPS)
            window["tokens"] = output_tokens() - tokens_before  # not one a row: prompts end mid-window
            window_s += time.perf_counter() - window_start
            window_tokens += window["tokens"]
            tries += 1
            prefill_profile = window if window["prefill_steps"] else None
            continue
        step_start, prefill_tokens = time.perf_counter(), engine.stats.prefill_tokens
        engine.step()
        # By what it did: a step that admits nobody while requests wait (`max_waiting_steps`) only decodes.
        kind = "decode" if engine.stats.prefill_tokens == prefill_tokens else "prefill"
        step_seconds[kind].append(time.perf_counter() - step_start)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start - window_s
    outputs = [engine.request(r).output_ids for r in request_ids]
    failed = [engine.request(r).error for r in request_ids if engine.request(r).error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    runner = engine.runner.stats if engine.runner is not None else None
    tokens = sum(len(o) for o in outputs)
    return dict(
        wall_s=wall,  # the profiled window left out
        output_tokens=tokens,  # every request's, the profiled window's included
        timed_tokens=tokens - window_tokens,
        tok_per_s=(tokens - window_tokens) / wall,
        profile_window=dict(seconds=window_s, tokens=window_tokens),
        warm_up_s=warm_up_s,
        num_steps=engine.stats.num_steps,
        num_async_steps=engine.stats.num_async_steps,
        max_waiting_steps=engine.scheduler.max_waiting_steps,
        num_blocks=pool.num_blocks,
        profile=step_profile,
        prefill_profile=prefill_profile,
        steps={
            kind: dict(steps=len(seconds), seconds=sum(seconds), ms_per_step=1e3 * sum(seconds) / max(len(seconds), 1))
            for kind, seconds in step_seconds.items()
        },
        runner=None if runner is None else dataclasses.asdict(runner),  # the warm-up's steps and captures included
        num_compiled_prefill_steps=engine.step_runner.step.num_compiled_steps if compile else 0,
        compile_error=engine.step_runner.step.compile_error if compile else None,
        decode_compile_error=engine.runner.compile_error if compile and engine.runner is not None else None,
        outputs=outputs,
    )


TOP_KERNELS = 12  # the CUDA kernels a profile lists, by time
# The other profile: steps that prefill beside decoding rows, one after the other, up to this many; a window whose
# first step did not prefill (admission waited) is left out of the timing all the same, and tried again up to
# PREFILL_PROFILE_TRIES times.
PREFILL_PROFILE_STEPS = 3
PREFILL_PROFILE_TRIES = 4


def profile_steps(engine: Engine, num_steps: int, cuda: bool, until_prefilled: int | None = None) -> dict:
    """Wall and CUDA kernel time of the next `num_steps` steps (decode-only ones, from where the caller calls it),
    and the kernels that take most of it; with `until_prefilled`, the steps that prefill one after the other, until
    that many have or one does not (which is then the last step profiled).

    On CUDA only kernels are traced: tracing every operator on the host too would slow the host down, and the host
    is what the step's wall time is made of when the GPU idles."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    rows = []
    prefill_tokens, prefill_steps = engine.stats.prefill_tokens, 0
    with profile(activities=activities) as profiler:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(num_steps):
            if not engine.has_unfinished():
                break
            rows.append(engine.num_running)
            before = engine.stats.prefill_tokens
            engine.step()
            prefilled = engine.stats.prefill_tokens != before
            prefill_steps += prefilled
            if until_prefilled is not None and (not prefilled or prefill_steps >= until_prefilled):
                break
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sorted(
        (e for e in profiler.key_averages() if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total
    )
    kernel_us = sum(e.self_device_time_total for e in kernels)
    steps = max(len(rows), 1)
    return dict(
        top_kernels=[
            dict(name=e.key[:100], calls_per_step=e.count / steps, us_per_step=e.self_device_time_total / steps)
            for e in kernels[:TOP_KERNELS]
        ],
        steps=len(rows),
        prefill_steps=prefill_steps,  # of them, the steps that prefilled
        prefill_tokens=engine.stats.prefill_tokens - prefill_tokens,
        tokens=sum(rows),  # a decode step adds one token per row
        mean_rows=sum(rows) / steps,
        wall_ms_per_step=wall / steps * 1e3,
        cuda_ms_per_step=kernel_us / 1e3 / steps,
        gpu_busy=kernel_us / 1e6 / wall if wall else 0.0,
    )


def run_peer_backend(name: str, model, workload, kv_bytes: int) -> dict:
    """transformers' continuous batching or static generate() batches, through the serving harness's runners."""
    from bench.continuous import run_peer
    from bench.static_batches import run_dynamic

    budget = Budget.for_workload(model, workload, 1.0)
    budget = dataclasses.replace(budget, multiple=kv_bytes / budget.reservation_bytes)
    result = (run_peer if name == "transformers-cb" else run_dynamic)(model, workload, budget)
    tokens = sum(len(o) for o in result.outputs)
    return dict(wall_s=result.wall_s, output_tokens=tokens, tok_per_s=tokens / result.wall_s, outputs=result.outputs)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's arguments (the burst, its lengths, the K/V memory and the Engine's limits), which
    bench/scheduler_host.py shares."""
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=[128, 1024])
    parser.add_argument("--output-lens", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float16", "float32", "none"])
    add_workload_arguments(parser)
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--check-requests", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a dry run on CPU")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda"
    if not cuda:  # graphs and the compiled decode forward need CUDA; the asynchronous run then runs eagerly
        args.backends = [b for b in args.backends if b not in CUDA_ONLY]
    shape = TINY_SHAPE if args.tiny else LLAMA_1B_SHAPE
    model = llama_shaped(shape, getattr(torch, args.dtype), args.device)
    workload = burst(
        vocab_size=shape["vocab_size"],
        num_requests=args.num_requests,
        prompt_lens=tuple(args.prompt_lens),
        output_lens=tuple(args.output_lens),
    )
    kv_bytes = parse_memory(args.kv_memory)
    results = {"args": vars(args), "device": device_name(args.device), "versions": versions(), "runs": {}}

    def save() -> None:
        """Write what is measured so far (a run stopped by a timeout leaves its finished backends)."""
        if args.json:
            runs = {name: {k: v for k, v in run.items() if k != "outputs"} for name, run in results["runs"].items()}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**results, "runs": runs}, indent=1))

    def check() -> None:
        """The graph and asynchronous runs' tokens against eager ones in float32 (once, before a compiled run)."""
        if cuda and args.check_dtype != "none" and "check" not in results:
            results["check"] = check_graph_tokens(args, shape, kv_bytes)
            save()
            print(f"graph and async vs eager tokens in {args.check_dtype}: {results['check']}")

    for name in args.backends:
        if name == "engine-async-compiled":  # its compiling may run out the step's time: the check comes first
            check()
        if name in ENGINE_MODES:
            graphs, overlap, waiting, compiled = ENGINE_MODES[name]
            options = dict(cuda_graphs=graphs and cuda, async_scheduling=overlap, max_waiting_steps=waiting)
            run = run_engine(model, workload, kv_bytes, args, profile=True, compile=compiled, warm_up=True, **options)
        else:
            run = run_peer_backend(name, model, workload, kv_bytes)
        results["runs"][name] = run
        save()
        window = run.get("profile_window") or {}
        left_out = f", {window['tokens']} profiled ones left out" if window.get("tokens") else ""
        print(
            f"{name:16s} {run['tok_per_s']:9.1f} output tok/s  ({run['output_tokens']} tokens{left_out}, "
            f"{run['wall_s']:.1f} s)"
        )
        if run.get("profile"):
            p = run["profile"]
            print(
                f"{'':16s} decode steps: {p['wall_ms_per_step']:.2f} ms wall, {p['cuda_ms_per_step']:.2f} ms CUDA "
                f"per step ({p['mean_rows']:.0f} rows): GPU busy {p['gpu_busy']:.0%}"
            )
        if run.get("prefill_profile"):
            p = run["prefill_profile"]
            print(
                f"{'':16s} {p['steps']} steps from one that prefills ({p['prefill_steps']} prefilled "
                f"{p['prefill_tokens']} tokens): {p['wall_ms_per_step']:.2f} ms wall, {p['cuda_ms_per_step']:.2f} ms "
                f"CUDA per step: GPU busy {p['gpu_busy']:.0%}"
            )
    runs = results["runs"]
    for other in ("engine-graphs", "engine-async"):
        if "engine" in runs and other in runs:
            same = sum(a == b for a, b in zip(runs["engine"]["outputs"], runs[other]["outputs"]))
            results[f"{other}_vs_eager_identical"] = f"{same}/{len(workload.requests)} ({args.dtype})"
    if "engine-async" in runs and "engine-async-compiled" in runs:  # the same graphs and scheduling, compiled or not
        same = sum(a == b for a, b in zip(runs["engine-async"]["outputs"], runs["engine-async-compiled"]["outputs"]))
        results["engine-async-compiled_vs_async_identical"] = f"{same}/{len(workload.requests)} ({args.dtype})"
    check()
    table = [
        [name, f"{run['tok_per_s']:.1f}", f"{run['tok_per_s'] / runs['transformers-cb']['tok_per_s']:.2f}x"]
        if "transformers-cb" in runs
        else [name, f"{run['tok_per_s']:.1f}", ""]
        for name, run in runs.items()
    ]
    print(tabulate(table, ["backend", "output tok/s", "vs transformers-cb"], tablefmt="github"))
    save()
    return 0


def check_graph_tokens(args, shape: dict, kv_bytes: int) -> str:
    """The first `--check-requests` requests in `--check-dtype`, eager, with graphs and with graphs and asynchronous
    scheduling: identical requests of each against the eager run."""
    model = llama_shaped(shape, getattr(torch, args.check_dtype), args.device)
    workload = burst(
        vocab_size=shape["vocab_size"],
        num_requests=args.check_requests,
        prompt_lens=tuple(args.prompt_lens),
        output_lens=(32, 64),
        seed=2,
    )
    eager = run_engine(model, workload, kv_bytes, args, cuda_graphs=False, profile=False)["outputs"]
    graphs = run_engine(model, workload, kv_bytes, args, cuda_graphs=True, profile=False)["outputs"]
    overlapped = run_engine(model, workload, kv_bytes, args, cuda_graphs=True, profile=False, async_scheduling=True)
    same = sum(a == b for a, b in zip(eager, graphs))
    same_async = sum(a == b for a, b in zip(eager, overlapped["outputs"]))
    return f"graphs {same}/{len(eager)}, graphs + async {same_async}/{len(eager)} requests identical"


if __name__ == "__main__":
    sys.exit(main())
