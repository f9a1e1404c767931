"""Static-batch runners: requests in arrival order, in batches as large as the budget holds, through generate().

"dynamic" (DynamicCache), "static" (StaticCache slots), "paged-generate" (PagedCache on a BlockPool of the budget)
and any third-party registry backend all run the same batches, so they differ only in storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, LogitsProcessorList

from hf_paged import PAGED_ATTENTION, BlockPool, PagedCache
from hf_paged import registry as hf_registry

from .cache_report import StepClock
from .runs import (
    BLOCK_SIZE,
    PAD_TOKEN_ID,
    STATIC_SLOT_TOKENS,
    Budget,
    RunResult,
    attention,
    generation_config,
    sleep_until,
)
from .workloads import Workload


def _left_padded(specs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, `[B, longest prompt]` int64, rows left-padded with PAD_TOKEN_ID."""
    width = max(len(s.prompt_ids) for s in specs)
    input_ids = torch.full((len(specs), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(specs), width), dtype=torch.long)
    for row, spec in enumerate(specs):
        input_ids[row, width - len(spec.prompt_ids) :] = torch.tensor(spec.prompt_ids)
        attention_mask[row, width - len(spec.prompt_ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def run_static_batches(
    model,
    workload: Workload,
    budget: Budget,
    *,
    backend: str,
    batch_size: int,
    new_cache: Callable[[], tuple[object, Callable[[], None]]],
    reserved_bytes: int,
    attn_implementation: str | None = "sdpa",
    held_bytes: Callable[[], int] | None = None,
) -> RunResult:
    """Requests in arrival order, `batch_size` at a time (times `num_samples` rows), through generate(); a batch
    starts when its last request has arrived and the previous batch is done. `new_cache()` -> (cache, release)."""
    config = generation_config(model, workload)
    num_samples = workload.num_samples
    n = workload.num_requests * num_samples  # sequences, request-major
    outputs, first_token, finish = [None] * n, [0.0] * n, [0.0] * n
    busy = []  # (seconds, rows) per batch
    live_seconds = 0.0  # summed over sequences: from their batch's start to their own last token
    live_peak = held_peak = wasted = 0
    with attention(model, attn_implementation):
        start = time.perf_counter()
        for first in range(0, workload.num_requests, batch_size):
            specs = workload.requests[first : first + batch_size]
            sleep_until(start + specs[-1].arrival)
            input_ids, attention_mask = _left_padded(specs, model.device)
            max_new_tokens = config.max_new_tokens = max(s.max_new_tokens for s in specs)
            cache, release = new_cache()
            clock = StepClock()
            torch.manual_seed(first)  # sampled workloads: reproducible per batch
            batch_start = time.perf_counter()
            try:
                out = model.generate(
                    input_ids,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([clock]),
                )
                if held_bytes is not None:
                    held_peak = max(held_peak, held_bytes())
            finally:
                release()
            busy.append((time.perf_counter() - batch_start, len(specs) * num_samples))
            assert len(clock.times) == max_new_tokens, (len(clock.times), max_new_tokens)
            # generate() expands each prompt into num_samples consecutive rows: row = request-major sequence order.
            for row in range(out.shape[0]):
                spec, index = specs[row // num_samples], first * num_samples + row
                # NOTE: a row's output is complete once its own last token exists; its later tokens are waste.
                outputs[index] = out[row, input_ids.shape[1] : input_ids.shape[1] + spec.max_new_tokens].tolist()
                first_token[index] = clock.times[0] - start
                finish[index] = clock.times[spec.max_new_tokens - 1] - start
                live_seconds += clock.times[spec.max_new_tokens - 1] - batch_start
                wasted += max_new_tokens - spec.max_new_tokens
            live_peak = max(live_peak, sum(_live_bytes(budget, spec, num_samples) for spec in specs))
        wall = time.perf_counter() - start
    return RunResult(
        backend=backend,
        multiple=budget.multiple,
        outputs=outputs,
        first_token=first_token,
        finish=finish,
        wall_s=wall,
        peak_concurrency=max(rows for _, rows in busy),
        mean_concurrency=sum(seconds * rows for seconds, rows in busy) / wall,
        mean_live=live_seconds / wall,
        reserved_bytes=reserved_bytes,
        live_bytes_peak=live_peak,
        held_bytes_peak=held_peak if held_bytes is not None else None,
        wasted_tokens=wasted,
        extra={"batch_size": batch_size, "rows_per_batch": batch_size * num_samples, "num_batches": len(busy)},
    )


def _live_bytes(budget: Budget, spec, num_samples: int) -> int:
    """K/V bytes of real tokens a request's `num_samples` sequences need at their end, what they share counted once:
    in a full-attention layer the prompt once plus every sequence's own outputs; in a sliding layer each sequence's
    last `window - 1` tokens (what DynamicCache keeps), the part of the prompt still among them once."""
    prompt, total = len(spec.prompt_ids), len(spec.prompt_ids) + spec.max_new_tokens
    live = budget.full_bytes_per_token * (prompt + num_samples * spec.max_new_tokens)
    for layer_bytes, window in budget.windows:
        kept = min(total, window - 1)
        shared = max(0, prompt - (total - kept))  # prompt tokens still in the window: the samples share them
        live += layer_bytes * (shared + num_samples * (kept - shared))
    return live


def dynamic_batch_size(budget: Budget, num_samples: int = 1) -> int:
    """Requests per static batch: as many worst-case rows (num_samples per request) as the budget holds, at least
    one request (which can exceed a small budget; the reserved bytes say so)."""
    return max(1, budget.bytes // (num_samples * budget.reservation_bytes))


def run_dynamic(model, workload: Workload, budget: Budget) -> RunResult:
    batch = dynamic_batch_size(budget, workload.num_samples)
    return run_static_batches(
        model,
        workload,
        budget,
        backend="dynamic",
        batch_size=batch,
        new_cache=lambda: (DynamicCache(config=model.config), lambda: None),
        reserved_bytes=batch * workload.num_samples * budget.reservation_bytes,
    )


def run_static(model, workload: Workload, budget: Budget, *, slot_tokens: int = STATIC_SLOT_TOKENS) -> RunResult:
    """StaticCache slots of max(`slot_tokens`, reservation) tokens: a slot is sized for the longest context a server
    accepts, not for the workload at hand, so fewer rows fit the budget (at least one, which can exceed it)."""
    slot = max(slot_tokens, budget.reservation_tokens)
    # StaticCache's sliding layers hold min(slot, window) tokens
    rows_bytes = workload.num_samples * budget.contiguous_bytes(slot, window_tokens=lambda window: window)
    batch = max(1, budget.bytes // rows_bytes)
    return run_static_batches(
        model,
        workload,
        budget,
        backend="static",
        batch_size=batch,
        new_cache=lambda: (hf_registry.create_cache("static", model, max_cache_len=slot), lambda: None),
        reserved_bytes=batch * rows_bytes,
    )


def run_paged_generate(model, workload: Workload, budget: Budget) -> RunResult:
    batch = dynamic_batch_size(budget, workload.num_samples)
    # The pool is the budget, or what dynamic reserves when a single request's rows exceed it (parallel sampling),
    # or, on a sliding-window model, what a batch's prompts hold during their one prefill forward: generate() computes
    # every left-padded prompt whole, and its sliding groups give blocks back only after that forward.
    rows = batch * workload.num_samples
    pool_bytes = max(
        budget.bytes, rows * budget.reservation_bytes, rows * budget.prefill_bytes(workload.max_prompt_len)
    )
    pool = BlockPool.for_model(model, max_memory=pool_bytes, block_size=BLOCK_SIZE)

    def new_cache():
        cache = PagedCache(config=model.config, pool=pool)
        return cache, cache.release

    return run_static_batches(
        model,
        workload,
        budget,
        backend="paged-generate",
        batch_size=batch,
        new_cache=new_cache,
        reserved_bytes=pool.num_blocks * pool.bytes_per_block,
        attn_implementation=PAGED_ATTENTION,
        held_bytes=lambda: pool.num_used_blocks * pool.bytes_per_block,
    )


def run_registry_backend(name: str, registry=None) -> Callable[..., RunResult]:
    """A runner for a third-party backend: the dynamic batches, each on `registry.create_cache(name, model)`."""
    registry = registry if registry is not None else hf_registry.registry

    def run(model, workload: Workload, budget: Budget) -> RunResult:
        batch = dynamic_batch_size(budget, workload.num_samples)

        def new_cache():
            cache = registry.create_cache(name, model)
            return cache, getattr(cache, "release", lambda: None)

        return run_static_batches(
            model,
            workload,
            budget,
            backend=name,
            batch_size=batch,
            new_cache=new_cache,
            reserved_bytes=batch * workload.num_samples * budget.reservation_bytes,
        )

    return run
