"""`python -m bench.scheduler_host`: the Engine's own host time per step, with no model, on the GPU workload.

On a GPU the host's work between two forwards (admission, scheduling, the step's inputs, bookkeeping) is time the
device waits, unless asynchronous scheduling hides it under the step before. This runs `bench/engine_speed.py`'s
workload (Llama-3.2-1B's shape, a burst of 128 requests, prompts 128-1024 and outputs 64-256 tokens, 1 GiB of
bf16 K/V, `max_num_seqs=128`, `max_num_batched_tokens=4096`) through the real `Engine` with `bench/replay.py`'s
stand-in forward, so every step takes the real decisions and only the model's time is missing. The stand-in's
vocabulary is cut to 128 entries (its argmax over 128,256 zeros would be device work on a GPU, not the host's).

It reports the steps with a prefill chunk and the decode-only ones, the host milliseconds each took, and admission's
share (`Admission.admit`: the lookahead each waiting request is tried against). Decode-only steps run through a decode
runner over the stand-in forward (`stand_in_runner`), as on a GPU, where the runner replays them as CUDA graphs: their
time is what a replayed graph leaves to the host (`--packed-decode` keeps them packed, as the stand-in alone would).

Then, for `--runner-rows`, an Engine decode step through the decode runner on the negligible-arithmetic model of
`bench/host_overhead.py`, its forward stood in by the logits of a real one: scheduling, the runner's inputs, the
argmax and the requests' bookkeeping, what a replayed CUDA graph leaves to the host (median of 60 steps, one
thread).

    python -m bench.scheduler_host
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_speed import add_workload_arguments  # noqa: E402
from bench.models import LLAMA_1B_SHAPE  # noqa: E402
from bench.replay import StandInModel  # noqa: E402
from bench.workloads import burst  # noqa: E402
from hf_paged import BlockPool, Engine  # noqa: E402
from hf_paged.engine.decode_runner import DecodeRunner  # noqa: E402
from hf_paged.storage.pool import parse_memory  # noqa: E402

STAND_IN_VOCAB = 128


def measure(
    *,
    num_requests: int = 128,
    prompt_lens: tuple[int, int] = (128, 1024),
    output_lens: tuple[int, int] = (64, 256),
    kv_memory: str = "1GiB",
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 4096,
    seed: int = 0,
    decode_runner: bool = True,
    max_waiting_steps: int = 0,
) -> dict:
    """Run the burst through an Engine with the stand-in forward; host seconds of each step by kind, and of
    admission over the whole run. `decode_runner`: decode-only steps through the decode runner, as on a GPU
    (`stand_in_runner`); False keeps them packed. `max_waiting_steps`: the Engine's (on a GPU with CUDA graphs it
    defaults to `GRAPH_MAX_WAITING_STEPS`; the stand-in runs none)."""
    config = LlamaConfig(**{**LLAMA_1B_SHAPE, "vocab_size": STAND_IN_VOCAB})
    model = StandInModel(config, dtype=torch.bfloat16)
    workload = burst(
        vocab_size=STAND_IN_VOCAB,
        num_requests=num_requests,
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        seed=seed,
    )
    pool = BlockPool.for_model(model, max_memory=parse_memory(kv_memory), block_size=16)
    engine = Engine(
        model,
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting_steps=max_waiting_steps,
    )
    runner = stand_in_runner(engine, max_num_seqs) if decode_runner else None
    for spec in workload.requests:
        engine.add_request(list(spec.prompt_ids), max_new_tokens=spec.max_new_tokens, ignore_eos=True)

    admission_times: list[float] = []
    admit = engine.scheduler.admission.admit

    def timed_admit(*args):
        start = time.perf_counter()
        try:
            return admit(*args)
        finally:
            admission_times.append(time.perf_counter() - start)

    engine.scheduler.admission.admit = timed_admit
    steps: dict[str, list[float]] = {"with prefill": [], "decode only": []}
    rows: dict[str, list[int]] = {"with prefill": [], "decode only": []}
    while engine.has_unfinished():
        prefill_tokens = engine.stats.prefill_tokens
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        kind = "decode only" if engine.stats.prefill_tokens == prefill_tokens else "with prefill"
        steps[kind].append(elapsed)
        rows[kind].append(engine.num_running)
    return dict(
        num_blocks=pool.num_blocks,
        num_steps=engine.stats.num_steps,
        num_preemptions=engine.stats.num_preemptions,
        output_tokens=sum(spec.max_new_tokens for spec in workload.requests),
        steps=steps,
        rows=rows,
        admission_s=sum(admission_times),
        runner_steps=0 if runner is None else runner.stats.eager_steps,
    )


def stand_in_runner(engine: Engine, max_num_seqs: int) -> DecodeRunner:
    """Give `engine` a decode runner over the stand-in forward, so decode-only steps take the runner's host path
    (the rows' inputs written into its buffers, its cache's steps, the logits of its rows), as they do on a GPU,
    where a replayed graph stands for the forward. The stand-in is no torch module, so the Engine made none."""
    step, pool = engine.step_runner.step, engine.pool
    runner = DecodeRunner(engine.model, pool, max_num_seqs, pool.num_blocks, step.cache_keyword, cuda_graphs=False)
    runner._run_model = lambda: torch.zeros(runner.num_rows, STAND_IN_VOCAB)
    step.runner = runner
    return runner


def runner_step(rows: int, steps: int = 60) -> float:
    """Median host seconds of an Engine decode step of `rows` requests (128-token prompts) through the decode runner,
    the model's forward replaced by the logits of a real one."""
    from bench.host_overhead import engine_for, negligible_model

    prompts = torch.randint(1, 128, (rows, 128), generator=torch.Generator().manual_seed(rows))
    engine = engine_for(negligible_model(), prompts, steps + 8, True)
    for _ in range(3):
        engine.step()
    with torch.inference_mode():
        logits = engine.runner._run_model()
    engine.runner._run_model = lambda: logits
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(result: dict) -> str:
    lines = []
    for kind, times in result["steps"].items():
        if not times:
            continue
        lines.append(
            [
                kind,
                len(times),
                f"{statistics.mean(result['rows'][kind]):.1f}",
                f"{statistics.mean(times) * 1e3:.2f}",
                f"{statistics.median(times) * 1e3:.2f}",
                f"{sum(times):.3f}",
            ]
        )
    total = sum(sum(times) for times in result["steps"].values())
    lines.append(
        ["all", result["num_steps"], "", f"{total / max(result['num_steps'], 1) * 1e3:.2f}", "", f"{total:.3f}"]
    )
    headers = ["steps", "count", "mean rows", "host ms/step (mean)", "host ms/step (median)", "host s"]
    return tabulate(lines, headers=headers, tablefmt="github")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_host", description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs; the one with the least host time is shown")
    parser.add_argument("--runner-rows", type=int, nargs="*", default=[1, 8, 64, 128])
    parser.add_argument(
        "--packed-decode", action="store_true", help="decode-only steps packed, not through the decode runner"
    )
    parser.add_argument(
        "--max-waiting-steps", type=int, nargs="+", default=[0], help="the Engine's, one run of the burst each"
    )
    args = parser.parse_args(argv)
    for max_waiting_steps in args.max_waiting_steps:
        runs = [
            measure(
                num_requests=args.num_requests,
                prompt_lens=tuple(args.prompt_lens),
                output_lens=tuple(args.output_lens),
                kv_memory=args.kv_memory,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                decode_runner=not args.packed_decode,
                max_waiting_steps=max_waiting_steps,
            )
            for _ in range(args.repeats)
        ]
        result = min(runs, key=lambda run: sum(sum(times) for times in run["steps"].values()))
        total = sum(sum(times) for times in result["steps"].values())
        print(
            f"max_waiting_steps {max_waiting_steps}: {args.num_requests} requests, {result['output_tokens']} output "
            f"tokens, {result['num_blocks']} blocks, {result['num_preemptions']} preemptions, "
            f"{result['runner_steps']} steps through the decode runner; best of {args.repeats}"
        )
        print(table(result))
        print(
            f"admission: {result['admission_s']:.3f} s ({result['admission_s'] / total:.0%} of the host time); "
            f"the host alone allows {result['output_tokens'] / total:,.0f} output tok/s\n"
        )
    if args.runner_rows:
        torch.set_num_threads(1)
        lines = []
        for rows in args.runner_rows:
            seconds = min(runner_step(rows) for _ in range(args.repeats))
            lines.append([rows, f"{seconds * 1e3:.3f}", f"{seconds * 1e6 / rows:.1f}"])
        print("\nAn Engine decode step through the decode runner, its forward stood in (best of the medians):")
        print(tabulate(lines, headers=["rows", "host ms/step", "host us/row"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
