"""`warm_up(engine)`: a short burst of synthetic requests before an Engine serves.

What compiles at its first use would otherwise compile in the first requests' time: each Triton kernel variant at
its first launch (seconds each on a fresh machine), the CUDA graphs of the batch buckets a burst reaches and, with
`compile_decode` / `compile_prefill`, torch.compile's two forwards (46.5 s for both on an H200 with a Llama-3.2-1B
shape: bench/logs/gpu-h200-5554460). vLLM compiles and captures at startup for the same reason.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from .stats import EngineStats

if TYPE_CHECKING:
    from .engine import Engine

# The burst: prompts of these lengths (the longest capped by the model and the pool), each generating as many tokens
# as given, so that steps that prefill run beside decode rows and the decode rows then finish one by one (buckets
# 4, 2 and 1 of the CUDA graphs).
PROMPT_LENS = (16, 64, 200, 400)
NEW_TOKENS = (4, 6, 8, 10)


def warm_up(engine: Engine, seed: int = 0) -> float:
    """Serve a short burst of synthetic requests (random token ids; prompts of up to 400 tokens, up to 10 new tokens
    each) on an idle `engine`, then put back its statistics (`engine.stats`) and forget the prefix-cache entries of
    the burst's prompts. Returns the seconds it took.

    Raises `ValueError` if a request is waiting or running (the burst would share its steps)."""
    if engine.has_unfinished():
        raise ValueError(
            f"warm_up needs an idle Engine: {engine.num_running} requests are running and {engine.num_waiting} waiting"
        )
    limits = [
        length - max(NEW_TOKENS)
        for length in (engine.limits.max_positions, engine.max_pool_tokens)
        if length is not None
    ]
    longest = max(1, min([max(PROMPT_LENS), *limits]))
    vocab_size = engine.model.config.get_text_config().vocab_size
    generator = random.Random(seed)
    prompts = [[generator.randrange(vocab_size) for _ in range(min(n, longest))] for n in PROMPT_LENS]
    allocator = engine.pool.allocator
    cached_before = {block for block in range(engine.pool.num_blocks) if allocator.is_cached(block)}
    start = time.perf_counter()
    engine.generate(prompts, max_new_tokens=list(NEW_TOKENS), ignore_eos=True)
    seconds = time.perf_counter() - start
    for block in range(engine.pool.num_blocks):
        if block not in cached_before and allocator.is_cached(block):
            allocator.uncache(block)
    engine.stats = EngineStats()
    return seconds
