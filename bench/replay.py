"""`python -m bench.replay`: the Engine's scheduling on a workload, without the model.

The real `Engine` and `Scheduler` run every step (admission, backfill, chunked prefill, preemption, prefix
caching, the `StepCache` each step would get), but the forward is a stand-in that returns uniform logits:
greedy rows take token 0, sampled rows draw from their own seeded generators, so parallel samples of one prompt
diverge as they do with a model. What the scheduler decides does not depend on token values: every request runs
to its `max_new_tokens`, and a request only ever finds its own blocks in the prefix cache (or a shared prompt's,
or a sibling sample's prompt). So the
steps, the rows per step, the blocks held and the preemptions are exactly those of `python -m bench` at the same
budget and knobs, in seconds instead of minutes; only the time each step takes is missing.

    python -m bench.replay --full --budgets 2,4,8,16
    python -m bench.replay --full --decode-reserve-tokens 0      # vLLM's admission: admit what fits, preempt
    python -m bench.replay --full --backfill-depth 1            # strict arrival order
    python -m bench.replay --full --workload long --layers mixed # the default sizes, 5 sliding : 1 full layers

What it is for: the knobs' effect on concurrency and preemption, and how close the mean rows come to the memory
bound (`of bound`; `bench/serving_report.py`, not shown where requests share prompt blocks, which it does not
count). Throughput needs the model: `python -m bench`.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from tabulate import tabulate
from transformers import LlamaConfig

from hf_paged import BlockPool, Engine

from .continuous import add_workload_request
from .models import DEFAULT_CONFIG, LAYERS, LAYERS_HELP, embedded_model
from .runs import BLOCK_SIZE, ENGINE_MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, Budget, budgets_arg
from .serving_report import concurrency_bound
from .static_batches import dynamic_batch_size
from .workloads import WORKLOADS, Workload, make_workload


class StandInModel:
    """What `Engine` needs of a model, with a forward that returns zero logits over the vocabulary (greedy: token
    0; sampled: uniform). `config`: a transformers config; the pool's layout and the sliding windows come from it."""

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        self.config = copy.deepcopy(config)
        self.config._attn_implementation = "hf_paged"  # what `Engine` switches a real model to
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.generation_config = None
        self.vocab_size = self.config.get_text_config(decoder=True).vocab_size

    def __call__(self, *, input_ids: torch.Tensor, logits_to_keep: torch.Tensor, **kwargs) -> SimpleNamespace:
        """input_ids [1, num_tokens], logits_to_keep [rows] -> logits [1, rows, vocab_size]."""
        return SimpleNamespace(logits=torch.zeros(1, len(logits_to_keep), self.vocab_size))


@dataclass
class Replay:
    multiple: float
    num_blocks: int
    num_steps: int
    mean_rows: float  # requests per step, the mean over steps
    peak_rows: int
    static_batch: int  # the "dynamic" backend's batch at this budget (rows per forward)
    bound: float  # the memory bound on mean concurrency (bench/serving_report.py)
    mean_occupancy: float  # blocks held after a step over the pool, the mean over steps
    num_preemptions: int
    prefill_tokens: int  # recomputation after preemption included
    prompt_tokens: int  # what the prefills would be without preemption or prefix hits
    prefix_hit_tokens: int


def replay(
    workload: Workload,
    multiple: float,
    *,
    config=None,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = ENGINE_MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    decode_reserve_tokens: int | None = None,
    backfill_depth: int = 8,
) -> Replay:
    """Run `workload` through an `Engine` on a pool of `multiple` worst-case reservations, as `python -m bench`
    does (same budget, same engine settings by default), with the stand-in forward.

    `config`: the model's config (default: the embedded model's). Raises ValueError for a workload whose requests
    do not all arrive at t=0 (arrivals are measured in seconds, and a replay has no clock).
    """
    late = [spec.arrival for spec in workload.requests if spec.arrival > 0]
    if late:
        raise ValueError(
            f"replay needs every request at t=0 (it has no clock); {workload.name!r} has {len(late)} of "
            f"{workload.num_requests} arriving later, the last at {max(late):.1f} s"
        )
    model = StandInModel(config if config is not None else LlamaConfig(**DEFAULT_CONFIG))
    budget = Budget.for_workload(model, workload, multiple)
    pool = BlockPool.for_model(model, max_memory=budget.bytes, block_size=block_size)
    engine = Engine(
        model,
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        decode_reserve_tokens=decode_reserve_tokens,
        backfill_depth=backfill_depth,
    )
    for index in range(workload.num_requests):
        add_workload_request(engine, workload, index)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats
    return Replay(
        multiple=multiple,
        num_blocks=pool.num_blocks,
        num_steps=stats.num_steps,
        mean_rows=stats.mean_running,
        peak_rows=stats.peak_running,
        static_batch=dynamic_batch_size(budget, workload.num_samples) * workload.num_samples,
        bound=concurrency_bound(workload, budget),
        # no step at all when the budget turns every request away
        mean_occupancy=stats.mean_used_blocks / pool.num_blocks,
        num_preemptions=stats.num_preemptions,
        prefill_tokens=stats.prefill_tokens,
        prompt_tokens=sum(len(spec.prompt_ids) for spec in workload.sequences),
        prefix_hit_tokens=stats.prefix_hit_tokens,
    )


def table(replays: list[Replay]) -> str:
    headers = [
        "budget",
        "blocks",
        "steps",
        "mean rows",
        "peak rows",
        "rows vs static batch",
        "of bound",
        "occupancy",
        "preemptions",
        "prefill / prompt tokens",
        "prefix hits",
    ]
    rows = [
        [
            f"{r.multiple:g}x",
            r.num_blocks,
            r.num_steps,
            f"{r.mean_rows:.2f}",
            r.peak_rows,
            f"{r.mean_rows / r.static_batch:.2f}",
            # the bound counts every sequence's blocks as its own: with shared prompt blocks it does not bound
            f"{r.mean_rows / r.bound:.2f}" if not r.prefix_hit_tokens else "-",
            f"{r.mean_occupancy:.2f}",
            r.num_preemptions,
            f"{r.prefill_tokens} / {r.prompt_tokens}",
            r.prefix_hit_tokens,
        ]
        for r in replays
    ]
    return tabulate(rows, headers=headers, tablefmt="github")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full workload sizes (default: quick, as python -m bench)")
    parser.add_argument("--workload", default="burst", choices=[w for w in WORKLOADS if w != "poisson"])
    parser.add_argument(
        "--budgets",
        type=budgets_arg,
        default=[2.0, 4.0, 8.0, 16.0],
        help="KV budgets in worst-case reservations, comma-separated (default 2,4,8,16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0, as python -m bench)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=None,
        help="the Engine's admission lookahead (default: to every request's end, never preempting)",
    )
    parser.add_argument("--backfill-depth", type=int, default=8)
    parser.add_argument("--layers", default="full", choices=LAYERS, help=LAYERS_HELP)
    args = parser.parse_args(argv)
    config = None if args.layers == "full" else embedded_model(args.layers).config
    workload = make_workload(args.workload, vocab_size=DEFAULT_CONFIG["vocab_size"], full=args.full, seed=args.seed)
    replays = [
        replay(
            workload,
            multiple,
            config=config,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            decode_reserve_tokens=args.decode_reserve_tokens,
            backfill_depth=args.backfill_depth,
        )
        for multiple in args.budgets
    ]
    print(f"{workload.name}: {workload.description}")
    print(table(replays))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
