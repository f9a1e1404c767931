"""Decode steps over a shared system prompt, the prefix read once for every row (cascade) vs every row's whole
context gathered: output tokens per second of the Engine, side by side in one run.

The workload is the HTTP benchmark's (`python -m bench.serve`) in process: every prompt is one shared system prompt
(`--prefix-len` tokens) then `--unique-len` tokens of its own; `--concurrency` requests are kept in flight (a new one
added as one finishes) until `--requests` have run, each for `--new-tokens` greedy tokens. The two settings take
turns, `--repeats` times each; the table shows every run, the best of each and their ratio, and whether both gave the
same tokens. The split is the decode runner's (`DecodeRunner.cascade_min_rows` / `cascade_min_tokens`); "off" sets
its row threshold past any step.

`--chunks` compares the runner's other CPU read instead, a large step's rows gathered and attended a chunk at a time
(`DecodeRunner.chunk_bytes`) against all at once, on a burst without a shared prefix: `--requests` requests at t=0,
prompts of `--prompt-lens` (128-384) tokens, outputs of `--output-lens` (128-256), all running together.

`--layer` times one layer's decode attention instead, the way the runner's torch path runs it, at the benchmark
model's heads (8 q / 4 kv of 64) and blocks of 16: every row's whole context gathered and SDPA with a length mask,
against the shared prefix gathered once and each row's tail (`shared_prefix_attention`), over rows x shared tokens x
tail tokens; what the runner's thresholds rest on.

    python -m bench.cascade --concurrency 32 16
    python -m bench.cascade --chunks --requests 48
    python -m bench.cascade --layer
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tabulate import tabulate

from hf_paged import BlockPool, Engine

from .models import load_model


def make_engine(model, args) -> Engine:
    """The Engine on a pool of `--max-memory`, refusing a model whose decode steps have no runner to compare."""
    pool = BlockPool.for_model(model, max_memory=args.max_memory, block_size=16)
    engine = Engine(model, pool)
    if engine.runner is None:
        raise SystemExit(f"this model's decode steps run packed ({engine.runner_reason}): no decode runner to compare")
    return engine


def drain(engine: Engine, order: dict[int, int], on_finished=None) -> tuple[float, dict[int, list[int]]]:
    """Step `engine` until it is done: (output tokens per second, each request's tokens by `order`, its request id ->
    its order of arrival). `on_finished()` runs after each finished request (to add another)."""
    tokens, outputs = 0, {}
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += len(engine.step())
        for request in engine.pop_finished():
            outputs[order[request.request_id]] = list(request.output_ids)
            if on_finished is not None:
                on_finished()
    return tokens / (time.perf_counter() - start), outputs


def run(model, args, concurrency: int, cascade: bool) -> tuple[float, dict[int, list[int]]]:
    """(output tokens per second, each request's tokens by its order of arrival)."""
    engine = make_engine(model, args)
    if not cascade:
        engine.runner.cascade_min_rows = 1 << 62
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    system = [rng.randrange(2, vocab) for _ in range(args.prefix_len)]
    order: dict[int, int] = {}

    def add() -> None:
        if len(order) < args.requests:
            prompt = system + [rng.randrange(2, vocab) for _ in range(args.unique_len)]
            order[engine.add_request(prompt, max_new_tokens=args.new_tokens, ignore_eos=True)] = len(order)

    for _ in range(concurrency):
        add()
    return drain(engine, order, add)


def run_burst(model, args, chunks: bool) -> tuple[float, dict[int, list[int]]]:
    """(output tokens per second, each request's tokens by its order of arrival) of the `--chunks` burst."""
    engine = make_engine(model, args)
    if args.chunk_bytes is not None:
        engine.runner.chunk_bytes = args.chunk_bytes
    if args.chunk_min_bytes is not None:
        engine.runner.chunk_min_bytes = args.chunk_min_bytes
    if not chunks:
        engine.runner.chunk_bytes = 0
    vocab, rng = model.config.vocab_size, random.Random(args.seed)
    order = {}
    for index in range(args.requests):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*args.prompt_lens))]
        order[engine.add_request(prompt, max_new_tokens=rng.randint(*args.output_lens), ignore_eos=True)] = index
    return drain(engine, order)


def layer_times(rows: int, shared_tokens: int, tail: int, repeats: int = 30) -> tuple[float, float, float]:
    """Milliseconds of one layer's decode attention (every row's context gathered, the shared prefix read once) and
    the largest difference between their outputs."""
    import torch.nn.functional as F

    from hf_paged.attention.shared_prefix import shared_prefix_attention
    from hf_paged.cache.block_tables import head_major_index
    from hf_paged.cache.fixed_width import gather_fixed

    heads, kv_heads, head_dim, block_size, num_blocks = 8, 4, 64, 16, 4000
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator) for _ in range(2))
    prefix_blocks, width = shared_tokens // block_size, shared_tokens + tail
    table_width = -(-width // block_size)
    tables = torch.randperm(num_blocks - prefix_blocks, generator=generator)[: rows * table_width] + prefix_blocks
    tables = tables.view(rows, table_width)
    tables[:, :prefix_blocks] = torch.arange(prefix_blocks)
    lengths = width - torch.randint(0, 10, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None])[:, None, None, :]
    query = torch.randn(rows, heads, 1, head_dim, generator=generator)
    buffers = [torch.empty(rows * kv_heads * table_width * block_size * head_dim) for _ in range(4)]

    def whole():
        index = head_major_index(tables, kv_heads, num_blocks)
        key, value = (gather_fixed(c, tables, width, index, b) for c, b in zip((keys, values), buffers))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)

    def split():
        prefix_tables, tail_tables = tables[:1, :prefix_blocks], tables[:, prefix_blocks:]
        index = head_major_index(prefix_tables, kv_heads, num_blocks)
        prefix = [gather_fixed(c, prefix_tables, shared_tokens, index, b) for c, b in zip((keys, values), buffers)]
        index = head_major_index(tail_tables, kv_heads, num_blocks)
        tails = [gather_fixed(c, tail_tables, tail, index, b) for c, b in zip((keys, values), buffers[2:])]
        return shared_prefix_attention(query, prefix[0], prefix[1], tails[0], tails[1], mask)

    difference = (whole() - split().transpose(1, 2)).abs().max().item()
    times = []
    for attend in (whole, split):
        attend()
        start = time.perf_counter()
        for _ in range(repeats):
            attend()
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return times[0], times[1], difference


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
    parser.add_argument("--layer", action="store_true", help="time one layer's attention, both ways (see above)")
    parser.add_argument("--chunks", action="store_true", help="rows read a chunk at a time or all at once (above)")
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=[128, 384], help="--chunks: prompt lengths")
    parser.add_argument("--output-lens", type=int, nargs=2, default=[128, 256], help="--chunks: output lengths")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="--chunks: the runner's (default: its own)")
    parser.add_argument("--chunk-min-bytes", type=int, default=None, help="--chunks: the runner's (default: its own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.chunks:
        model = load_model(args.model)
        speeds, outputs = {False: [], True: []}, {}
        for _ in range(args.repeats):
            for chunks in (False, True):
                speed, outputs[chunks] = run_burst(model, args, chunks)
                speeds[chunks].append(speed)
        row = {
            "requests": args.requests,
            "all rows at once (tok/s)": " / ".join(f"{speed:.1f}" for speed in speeds[False]),
            "a chunk at a time (tok/s)": " / ".join(f"{speed:.1f}" for speed in speeds[True]),
            "best ratio": f"{max(speeds[True]) / max(speeds[False]):.2f}x",
            "same tokens": outputs[True] == outputs[False],
        }
        print(tabulate([row], headers="keys"))
        return 0
    if args.layer:
        table = []
        for rows in (2, 4, 8, 32):
            for shared_tokens in (16, 64, 256):
                for tail in (20, 150, 600):
                    whole, split, _ = layer_times(rows, shared_tokens, tail)
                    table.append([rows, shared_tokens, tail, f"{whole:.3f}", f"{split:.3f}", f"{split / whole:.2f}x"])
        headers = ["rows", "shared tokens", "tail tokens", "gather every row (ms)", "prefix once (ms)", "ratio"]
        print(tabulate(table, headers=headers))
        return 0
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
