"""`warm_up(engine)`: short bursts of synthetic requests before an Engine serves.

What compiles at its first use would otherwise compile in the first requests' time: each Triton kernel variant at
its first launch (seconds each on a fresh machine), the CUDA graph of each batch bucket and, with `compile_decode` /
`compile_prefill`, torch.compile's two forwards (46.5 s for both on an H200 with a Llama-3.2-1B shape:
bench/logs/gpu-h200-5554460). vLLM compiles and captures at startup for the same reason.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from ..errors import RequestFailed
from .stats import EngineStats

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)

# The first burst: prompts of these lengths (capped by the model and the pool), each generating as many tokens as
# given, so that steps that prefill run beside decode rows, over prompts of several tables' widths.
PROMPT_LENS = (16, 64, 200, 400)
NEW_TOKENS = (4, 6, 8, 10)
# The second: `max_num_seqs` prompts of this many tokens, request i generating i + 1 tokens, so that the decode
# batch shrinks by one a step through every bucket of the CUDA graphs.
SHORT_PROMPT = 8


def warm_up(engine: Engine, seed: int = 0) -> float:
    """Serve two short bursts of synthetic requests (random token ids) on an idle `engine`: prompts of 16 to 400 tokens
    with up to 10 new tokens each, then `max_num_seqs` prompts of 8 tokens finishing one a step. Then put back its
    counters (`engine.stats`, the scheduler's and the pool's prefix-cache counts) and forget what the bursts added to
    the prefix cache. Returns the seconds it took.

    Best effort: a burst the model or the pool cannot take (requests refused or failed) is logged and skipped.
    Raises `ValueError` if a request is waiting or running (the bursts would share its steps)."""
    if engine.has_unfinished():
        raise ValueError(
            f"warm_up needs an idle Engine: {engine.num_running} requests are running and {engine.num_waiting} waiting"
        )
    limit = min((n for n in (engine.limits.max_positions, engine.max_pool_tokens) if n is not None), default=None)
    vocab_size = engine.limits.vocab_size or engine.model.config.get_text_config(decoder=True).vocab_size
    generator = random.Random(seed)
    max_num_seqs = engine.scheduler.max_num_seqs
    bursts = [
        (PROMPT_LENS, NEW_TOKENS),
        ((SHORT_PROMPT,) * max_num_seqs, tuple(range(1, max_num_seqs + 1))),
    ]
    allocator, scheduler = engine.pool.allocator, engine.scheduler
    cached_before = allocator.cached_blocks()
    counts_before = (scheduler.num_preemptions, scheduler.prefix.num_hit_tokens)
    queries_before = (allocator.num_prefix_queries, allocator.num_prefix_hits)
    stats, engine.stats = engine.stats, EngineStats()  # the bursts count in a statistics object of their own
    start = time.perf_counter()
    for prompt_lens, new_tokens in bursts:
        if limit is not None:  # each request's prompt and new tokens fit the model's positions and the pool
            new_tokens = tuple(min(n, max(1, limit // 2)) for n in new_tokens)
            prompt_lens = tuple(max(1, min(p, limit - n)) for p, n in zip(prompt_lens, new_tokens))
        prompts = [[generator.randrange(vocab_size) for _ in range(p)] for p in prompt_lens]
        try:
            engine.generate(prompts, max_new_tokens=list(new_tokens), ignore_eos=True)
        except RequestFailed as error:
            logger.warning("Engine warm-up: a burst of synthetic requests failed, skipped: %s", error)
    seconds = time.perf_counter() - start
    for block, block_hash in allocator.cached_blocks().items():
        if cached_before.get(block) != block_hash:
            allocator.uncache(block)
    scheduler.num_preemptions, scheduler.prefix.num_hit_tokens = counts_before
    allocator.num_prefix_queries, allocator.num_prefix_hits = queries_before
    engine.stats = stats
    return seconds
