"""Continuous-batching runners: hf_paged's Engine and transformers' own continuous batching (the peer)."""

from __future__ import annotations

import time

import torch
from transformers import ContinuousBatchingConfig

from hf_paged import BlockPool, Engine

from .runs import (
    BLOCK_SIZE,
    ENGINE_MAX_NUM_SEQS,
    MAX_NUM_BATCHED_TOKENS,
    OPTIMISTIC,
    PEER,
    Budget,
    RunResult,
    attention,
    generation_config,
    sleep_until,
)
from .workloads import Workload


def _engine_live_bytes(requests, pool: BlockPool) -> int:
    """K/V bytes of computed tokens in the blocks the unfinished requests hold (every layer group; a block shared by
    a prefix hit counted once)."""
    block_size = pool.block_size
    held: dict[int, int] = {}
    for request in requests:
        if request.finished:
            continue
        for table, first in zip(request.block_tables, request.first_blocks):
            for index, block_id in enumerate(table, start=first):
                tokens = min(block_size, request.num_computed - index * block_size)
                held[block_id] = max(held.get(block_id, 0), tokens)
    # NOTE: a block holds `block_size` tokens of the layers of its group: pool.bytes_per_block covers them.
    return sum(tokens for tokens in held.values() if tokens > 0) * pool.bytes_per_block // block_size


def _num_live(engine: Engine, events: list[tuple[int, int]]) -> int:
    """Requests live in the step that produced `events`: those holding K/V after it (started and not finished, a
    prompt waiting between prefill chunks included) and those whose last token it produced. One admitted but not
    started (no block yet), or preempted, is not live; so a sequence counts from its first forward to its last
    token, as in the static batches, less a preempted request's wait to be recomputed."""
    finished = sum(1 for request_id, _ in events if engine.request(request_id).finished)
    return finished + sum(1 for request in engine.scheduler.running if request.block_tables)


def add_workload_request(engine: Engine, workload: Workload, index: int) -> list[int]:
    """Queue workload request `index` on `engine` as its `num_samples` sequences (sampled ones seeded by their
    sequence index, request-major), every one running to its `max_new_tokens`; returns their engine request ids."""
    spec = workload.requests[index]
    sampling = dict(temperature=workload.temperature) if workload.sampled else {}
    request_ids = []
    for sample in range(workload.num_samples):
        if workload.sampled:
            sampling["seed"] = index * workload.num_samples + sample
        request_ids.append(
            engine.add_request(list(spec.prompt_ids), max_new_tokens=spec.max_new_tokens, ignore_eos=True, **sampling)
        )
    return request_ids


def run_engine(
    model, workload: Workload, budget: Budget, *, decode_reserve_tokens: int | None = None, backend: str = "engine"
) -> RunResult:
    """hf_paged's Engine; each request is added once its arrival time has passed, as `num_samples` engine requests
    (seeded) for a sampled workload. `decode_reserve_tokens` goes to the Engine (None: admission looks ahead to
    every request's `max_new_tokens` and never preempts; 0: admit what fits now and preempt when a row needs a
    block, as vLLM does)."""
    pool = BlockPool.for_model(model, max_memory=budget.bytes, block_size=BLOCK_SIZE)
    n = workload.num_requests
    added = 0  # workload requests added so far
    request_ids = []  # engine request ids, one per sequence, request-major
    busy = []  # (seconds, requests that ran, requests live) per step
    live_peak = held_peak = 0
    with attention(model, None):  # the Engine switches to "hf_paged"; give the model back as it was
        engine = Engine(
            model,
            pool,
            max_num_seqs=ENGINE_MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            decode_reserve_tokens=decode_reserve_tokens,
        )
        start = time.perf_counter()
        while added < n or engine.has_unfinished():
            now = time.perf_counter() - start
            while added < n and workload.requests[added].arrival <= now:
                request_ids += add_workload_request(engine, workload, added)
                added += 1
            if not engine.has_unfinished():
                sleep_until(start + workload.requests[added].arrival)
                continue
            ran_before, step_start = engine.stats.running_sum, time.perf_counter()
            events = engine.step()
            if pool.device.type == "cuda":  # the step's time is its kernels' time, not their launch
                torch.cuda.synchronize(pool.device)
            busy.append(
                (time.perf_counter() - step_start, engine.stats.running_sum - ran_before, _num_live(engine, events))
            )
            held = pool.num_used_blocks * pool.bytes_per_block
            held_peak = max(held_peak, held)
            if held > live_peak:  # live <= held: a step holding no more than the live peak cannot raise it
                live_peak = max(live_peak, _engine_live_bytes(engine.scheduler.running, pool))
        wall = time.perf_counter() - start
    requests = [engine.request(r) for r in request_ids]
    failed = {i: r.error for i, r in enumerate(requests) if r.error}
    if failed:
        raise RuntimeError(f"{backend}: {len(failed)} requests failed: {failed}")
    stats = engine.stats
    # NOTE: every engine row is a request that still owes tokens (it retires at its last one): no padding rows.
    mean_rows = sum(seconds * rows for seconds, rows, _ in busy) / wall
    mean_live = sum(seconds * live for seconds, _, live in busy) / wall
    return RunResult(
        backend=backend,
        multiple=budget.multiple,
        outputs=[list(r.output_ids) for r in requests],
        first_token=[r.first_token_time - start for r in requests],
        finish=[r.finish_time - start for r in requests],
        wall_s=wall,
        peak_concurrency=stats.peak_running,
        mean_concurrency=mean_rows,
        mean_live=mean_live,
        reserved_bytes=pool.num_blocks * pool.bytes_per_block,
        live_bytes_peak=live_peak,
        held_bytes_peak=held_peak,
        num_preemptions=stats.num_preemptions,
        extra={
            "num_steps": stats.num_steps,
            "mean_running_per_step": stats.mean_running,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "num_blocks": pool.num_blocks,
            "prefix_hit_tokens": getattr(stats, "prefix_hit_tokens", 0),
        },
    )


def run_engine_optimistic(model, workload: Workload, budget: Budget) -> RunResult:
    """The Engine with vLLM's admission: a request is admitted when its prompt fits now (no room kept for growth),
    and the most recently admitted request is preempted (recomputed later) when a row (decode or prefill chunk)
    needs a block and none is free."""
    return run_engine(model, workload, budget, decode_reserve_tokens=0, backend=OPTIMISTIC)


def run_peer(model, workload: Workload, budget: Budget) -> RunResult:
    """transformers' continuous batching (the manager `generate_batch` uses), with per-request max_new_tokens.

    The budget is its `num_blocks` (whole-model blocks of `page_size` tokens, the same bytes as our blocks);
    `max_batch_tokens` and `max_requests_per_batch` match the engine's. It stays on sdpa (by default it switches to
    flash attention where that is installed) and without async double-buffering, which on CUDA would double its
    K/V memory past the budget; CUDA graphs are its own call.
    """
    num_blocks = budget.bytes // (budget.bytes_per_token * BLOCK_SIZE)
    cb_config = ContinuousBatchingConfig(
        seed=0,
        page_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=ENGINE_MAX_NUM_SEQS,
        auto_switch_to_flash=False,
        use_async_batching=False,
    )
    config = generation_config(model, workload)
    config.eos_token_id = -1  # its way of saying "no eos"
    config.max_new_tokens = workload.max_new_tokens
    # Sequence ids, request-major: a request with num_samples > 1 forks children named "<id>__child#<k>".
    sequence_ids = [
        f"r{index}" if sample == 0 else f"r{index}__child#{sample - 1}"
        for index in range(workload.num_requests)
        for sample in range(workload.num_samples)
    ]
    n = len(sequence_ids)
    results = {}
    with (
        attention(model, "sdpa"),
        model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, timeout=60
        ) as manager,
    ):
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        reserved = int(cache.cache_tensor.numel() * cache.cache_tensor.element_size()) if cache is not None else 0
        # Its cache tensor starts with scratch sectors that padding tokens write to, never given to a request.
        capacity = getattr(cache, "num_sectors", 0) * getattr(cache, "bytes_per_sector", 0)
        scratch = reserved - capacity if 0 < capacity <= reserved else 0
        start = time.perf_counter()
        for index, spec in enumerate(workload.requests):
            sleep_until(start + spec.arrival)
            manager.add_request(
                list(spec.prompt_ids),
                request_id=f"r{index}",
                max_new_tokens=spec.max_new_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )
        while len(results) < n:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"{PEER}: the generation thread stopped with {n - len(results)} requests left")
        wall = time.perf_counter() - start
    ordered = [results[sequence_id] for sequence_id in sequence_ids]
    failed = {i: r.error for i, r in enumerate(ordered) if r.error is not None}
    if failed:
        raise RuntimeError(f"{PEER}: {len(failed)} requests failed: {failed}")
    # Concurrency from each request's lifespan (left the queue, finished). Its live K/V is not observable from
    # outside: chunked prefill, prefix sharing and evictions happen inside its cache, so none is reported.
    spans = [(r.lifespan[0] - start, r.lifespan[1] - start) for r in ordered]
    mean_span = sum(e - s for s, e in spans) / wall  # a lifespan ends at the last token: no padding to leave out
    return RunResult(
        backend=PEER,
        multiple=budget.multiple,
        outputs=[list(r.generated_tokens) for r in ordered],
        first_token=[r.timestamps[0] - start for r in ordered],
        finish=[r.timestamps[-1] - start for r in ordered],
        wall_s=wall,
        peak_concurrency=max(sum(s <= t < e for s, e in spans) for t, _ in spans),
        mean_concurrency=mean_span,
        mean_live=mean_span,
        reserved_bytes=reserved or num_blocks * budget.bytes_per_token * BLOCK_SIZE,
        live_bytes_peak=None,
        extra={"num_blocks": num_blocks, "page_size": BLOCK_SIZE, "scratch_bytes": scratch},
    )
