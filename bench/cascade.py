"""Decode steps over a shared system prompt, the prefix read once for every row (cascade) vs every row's whole
context gathered: output tokens per second of the Engine, side by side in one run.

The workload is the HTTP benchmark's (`python -m bench.serve`) in process: every prompt is one shared system prompt
(`--prefix-len` tokens) then `--unique-len` tokens of its own; `--concurrency` requests are kept in flight (a new one
added as one finishes) until `--requests` have run, each for `--new-tokens` greedy tokens. The two settings take
turns, `--repeats` times each; the table shows every run, the best of each and their ratio, and whether both gave the
same tokens. The split is the decode runner's (`DecodeRunner.cascade_min_rows` / `cascade_min_tokens`); "off" sets
its row threshold past any step.

    python -m bench.cascade --concurrency 32 16
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tabulate import tabulate

from hf_paged import BlockPool, Engine

from .models import load_model


def run(model, args, concurrency: int, cascade: bool) -> tuple[float, dict[int, list[int]]]:
    """(output tokens per second, each request's tokens by its order of arrival)."""
    pool = BlockPool.for_model(model, max_memory=args.max_memory, block_size=16)
    engine = Engine(model, pool)
    if engine.runner is None:
        raise SystemExit(f"this model's decode steps run packed ({engine.runner_reason}): no decode runner to compare")
    if not cascade:
        engine.runner.cascade_min_rows = 1 << 62
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    system = [rng.randrange(2, vocab) for _ in range(args.prefix_len)]
    order: dict[int, int] = {}

    def add() -> None:
        prompt = system + [rng.randrange(2, vocab) for _ in range(args.unique_len)]
        order[engine.add_request(prompt, max_new_tokens=args.new_tokens, ignore_eos=True)] = len(order)

    for _ in range(min(concurrency, args.requests)):
        add()
    tokens, outputs = 0, {}
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += len(engine.step())
        for request in engine.pop_finished():
            outputs[order[request.request_id]] = list(request.output_ids)
            if len(order) < args.requests:
                add()
    return tokens / (time.perf_counter() - start), outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cascade", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 16])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prefix-len", type=int, default=276, help="the shared system prompt (default: %(default)s)")
    parser.add_argument("--unique-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-memory", default="128MiB", help="the pool's K/V memory (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    rows = []
    for concurrency in args.concurrency:
        speeds, outputs = {False: [], True: []}, {}
        for _ in range(args.repeats):
            for cascade in (False, True):
                speed, outputs[cascade] = run(model, args, concurrency, cascade)
                speeds[cascade].append(speed)
        rows.append(
            {
                "concurrency": concurrency,
                "gather every row (tok/s)": " / ".join(f"{speed:.1f}" for speed in speeds[False]),
                "prefix once (tok/s)": " / ".join(f"{speed:.1f}" for speed in speeds[True]),
                "best ratio": f"{max(speeds[True]) / max(speeds[False]):.2f}x",
                "same tokens": outputs[True] == outputs[False],
            }
        )
    print(tabulate(rows, headers="keys"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
