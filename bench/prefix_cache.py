"""Shared-system-prompt workload on the Engine, prefix caching on vs off: prompt tokens computed and TTFT.

All requests arrive at t=0 and share one system prompt; each adds a few unique tokens. Run with
`python -m bench.prefix_cache` (the serving harness has the same workload: `python -m bench --workload shared-prefix`);
`--layers sliding` / `--layers mixed` run the default model's sizes with every layer sliding (Mistral-style, one
sliding layer group) or 5 sliding layers to 1 full one (Gemma3-style; `BlockPool` makes each layer its own group),
window 256.
"""

from __future__ import annotations

import statistics

import torch

from hf_paged import BlockPool, Engine


def shared_prefix_prompts(vocab_size: int, *, num_requests: int, prefix_len: int, unique_range, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(2, vocab_size, (prefix_len,), generator=generator).tolist()
    lengths = torch.randint(unique_range[0], unique_range[1] + 1, (num_requests,), generator=generator).tolist()
    return [system + torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def shared_prefix(
    model,
    *,
    num_requests: int = 64,
    prefix_len: int = 512,
    unique_range=(32, 128),
    max_new_tokens: int = 16,
    max_memory: int | None = None,
) -> list[dict]:
    """One row per setting (cache off, cache on), plus the on/off ratios in the second row."""
    prompts = shared_prefix_prompts(
        model.config.vocab_size, num_requests=num_requests, prefix_len=prefix_len, unique_range=unique_range
    )
    rows, outputs = [], {}
    for caching in (False, True):
        budget = max_memory or 2 * sum(len(p) + max_new_tokens for p in prompts) * _bytes_per_token(model)
        engine = Engine(model, BlockPool.for_model(model, max_memory=budget), enable_prefix_caching=caching)
        start = None
        request_ids = []
        for prompt in prompts:
            request_ids.append(engine.add_request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True))
            start = engine.request(request_ids[0]).arrival_time
        while engine.has_unfinished():
            engine.step()
        requests = [engine.request(r) for r in request_ids]
        ttfts = [r.first_token_time - start for r in requests]
        outputs[caching] = [r.output_ids for r in requests]
        stats = engine.stats
        rows.append(
            {
                "prefix_caching": caching,
                "requests": num_requests,
                "shared_prefix": prefix_len,
                "prompt_tokens": sum(map(len, prompts)),
                "prefill_tokens_computed": stats.prefill_tokens,
                "prefix_hit_tokens": stats.prefix_hit_tokens,
                "ttft_p50_s": statistics.median(ttfts),
                "wall_s": max(r.finish_time for r in requests) - start,
            }
        )
    off, on = rows
    on["computed_ratio"] = on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    on["ttft_p50_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    on["identical_outputs"] = outputs[True] == outputs[False]
    return rows


def _bytes_per_token(model) -> int:
    pool = BlockPool.for_model(model, num_blocks=1)
    return pool.bytes_per_block // pool.block_size


def main() -> None:
    import argparse

    from tabulate import tabulate

    from .models import LAYERS, LAYERS_HELP, embedded_model, load_model

    parser = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--model", default=None, help="a checkpoint path (default: the embedded model)")
    parser.add_argument("--layers", default="full", choices=LAYERS, help=LAYERS_HELP)
    args = parser.parse_args()
    if args.model is not None and args.layers != "full":
        parser.error("--layers applies to the embedded model, not to --model")
    model = load_model(args.model) if args.model is not None else embedded_model(args.layers)
    rows = shared_prefix(model, num_requests=args.requests, prefix_len=args.prefix_len)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))


if __name__ == "__main__":
    main()
