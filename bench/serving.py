"""Serving benchmark: one workload served by each backend under the same KV budget, timed request by request.

The KV budget is `multiple x one worst-case reservation`, where a reservation is the longest prompt plus the longest
output of the workload, in tokens (rounded up to whole blocks, so a paged row of that length fits), times the K/V
bytes of one token. Backends:

    dynamic            static batches of `budget // reservation` requests through generate() + DynamicCache
    static             the same with StaticCache slots of max(1024, reservation) tokens: fewer rows fit
    paged-generate     the same batches as dynamic, PagedCache on a BlockPool of the budget
    engine             hf_paged's continuous-batching Engine on a BlockPool of the budget
    hf-generate-batch  transformers' own continuous batching (the manager behind `generate_batch`), the budget
                       given as its `num_blocks` of `page_size` 16
    <plugin name>      any third-party cache backend: the dynamic batches on `create_cache(name, model)`

A static batch always takes at least one request, so at a budget below one request's rows (parallel sampling) the
static-batch backends reserve more than the budget; `RunResult.reserved_bytes` says how much.
Every run returns a `RunResult` (outputs and per-sequence times); `bench/serving_report.py` turns them into metrics.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig, LogitsProcessorList

from hf_paged import PAGED_ATTENTION, BlockPool, Engine, KVLayout, PagedCache
from hf_paged import registry as hf_registry

from .cache_report import _StepClock
from .workloads import Workload

BLOCK_SIZE = 16
PAD_TOKEN_ID = 0
STATIC_SLOT_TOKENS = 1024
ENGINE_MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 512
PEER = "hf-generate-batch"
BUILTIN_BACKENDS = ("dynamic", "static", "paged-generate", "engine", PEER)
# Registry backends that the built-in runners above already cover.
COVERED_REGISTRY_BACKENDS = ("dynamic", "static", "paged")


@dataclass(frozen=True)
class Budget:
    multiple: float
    reservation_tokens: int  # one worst-case request, rounded up to whole blocks
    bytes_per_token: int  # K/V of one token, every layer

    @property
    def reservation_bytes(self) -> int:
        return self.reservation_tokens * self.bytes_per_token

    @property
    def bytes(self) -> int:
        return int(self.multiple * self.reservation_bytes)

    @classmethod
    def for_workload(cls, model, workload: Workload, multiple: float) -> Budget:
        layout = KVLayout.from_config(model.config)
        bytes_per_block = layout.bytes_per_block(BLOCK_SIZE, model.dtype)
        assert bytes_per_block % BLOCK_SIZE == 0, bytes_per_block
        worst = workload.max_prompt_len + workload.max_new_tokens
        # NOTE: rounded up to whole blocks so that `multiple` paged rows of the worst length fit a pool of the
        # budget, as they fit `multiple` contiguous slots; the difference is under one block per request.
        reservation = -(-worst // BLOCK_SIZE) * BLOCK_SIZE
        return cls(multiple, reservation, bytes_per_block // BLOCK_SIZE)


@dataclass
class RunResult:
    """One backend serving one workload under one budget. Times are seconds since the run started."""

    backend: str
    multiple: float
    outputs: list[list[int]]  # per request, exactly its max_new_tokens tokens
    first_token: list[float]
    finish: list[float]
    wall_s: float
    peak_concurrency: int
    mean_concurrency: float  # time-weighted over the wall time
    reserved_bytes: int  # K/V memory the backend set aside
    live_bytes_peak: int | None  # K/V bytes of real tokens (prompt + own outputs) at the peak; None: not observable
    held_bytes_peak: int | None = None  # pool blocks in use at the peak (paged backends)
    num_preemptions: int = 0
    wasted_tokens: int = 0  # generated past a request's own max_new_tokens (static batches)
    extra: dict = field(default_factory=dict)


@contextmanager
def attention(model, name: str | None):
    """Run with `model` on attention implementation `name` (None: as it is); restore the original afterwards."""
    original = model.config._attn_implementation
    if name is not None and name != original:
        model.set_attn_implementation(name)
    try:
        yield model
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def generation_config(model, workload: Workload | None = None) -> GenerationConfig:
    """The model's generation config, never stopping at eos, padding with PAD_TOKEN_ID: greedy, or for a sampled
    workload plain temperature sampling (no top-k/top-p, as the engine samples) with `num_samples` sequences."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = None, PAD_TOKEN_ID
    if workload is not None and workload.sampled:
        config.do_sample, config.temperature, config.top_k, config.top_p = True, workload.temperature, 0, 1.0
        config.num_return_sequences = workload.num_samples
    else:
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    return config


def reference_outputs(model, workload: Workload, *, progress: bool = True) -> list[list[int]] | None:
    """Each request alone through generate() with DynamicCache on sdpa: what every backend must reproduce.
    None for a sampled workload (samples from different generators are not comparable token for token)."""
    if workload.sampled:
        return None
    config = generation_config(model)
    outputs = []
    with attention(model, "sdpa"):
        for spec in tqdm(workload.requests, desc="reference generate()", disable=not progress, leave=False):
            input_ids = torch.tensor([spec.prompt_ids], device=model.device)
            config.max_new_tokens = spec.max_new_tokens
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=DynamicCache(config=model.config),
                generation_config=config,
            )
            outputs.append(out[0, input_ids.shape[1] :].tolist())
    return outputs


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------------------------- static batches
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
    live_peak = held_peak = wasted = 0
    with attention(model, attn_implementation):
        start = time.perf_counter()
        for first in range(0, workload.num_requests, batch_size):
            specs = workload.requests[first : first + batch_size]
            _sleep_until(start + specs[-1].arrival)
            input_ids, attention_mask = _left_padded(specs, model.device)
            max_new_tokens = config.max_new_tokens = max(s.max_new_tokens for s in specs)
            cache, release = new_cache()
            clock = _StepClock()
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
                wasted += max_new_tokens - spec.max_new_tokens
            # Live: each prompt once (samples share it in content) plus every sequence's own outputs.
            live_tokens = sum(len(s.prompt_ids) + num_samples * s.max_new_tokens for s in specs)
            live_peak = max(live_peak, live_tokens * budget.bytes_per_token)
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
        reserved_bytes=reserved_bytes,
        live_bytes_peak=live_peak,
        held_bytes_peak=held_peak if held_bytes is not None else None,
        wasted_tokens=wasted,
        extra={"batch_size": batch_size, "rows_per_batch": batch_size * num_samples, "num_batches": len(busy)},
    )


def dynamic_batch_size(budget: Budget, num_samples: int = 1) -> int:
    """Requests per static batch: as many worst-case rows (num_samples per request) as the budget holds, at least
    one request (which can exceed a small budget; the reserved bytes say so)."""
    return max(1, budget.bytes // (num_samples * budget.reservation_bytes))


def run_dynamic(model, workload: Workload, budget: Budget) -> RunResult:
    batch = dynamic_batch_size(budget, workload.num_samples)
    return run_static_batches(
        model, workload, budget, backend="dynamic", batch_size=batch,
        new_cache=lambda: (DynamicCache(config=model.config), lambda: None),
        reserved_bytes=batch * workload.num_samples * budget.reservation_bytes,
    )


def run_static(model, workload: Workload, budget: Budget) -> RunResult:
    slot = max(STATIC_SLOT_TOKENS, budget.reservation_tokens)
    rows_bytes = workload.num_samples * slot * budget.bytes_per_token
    batch = max(1, budget.bytes // rows_bytes)
    return run_static_batches(
        model, workload, budget, backend="static", batch_size=batch,
        new_cache=lambda: (hf_registry.create_cache("static", model, max_cache_len=slot), lambda: None),
        reserved_bytes=batch * rows_bytes,
    )


def run_paged_generate(model, workload: Workload, budget: Budget) -> RunResult:
    batch = dynamic_batch_size(budget, workload.num_samples)
    # The pool is the budget, or what dynamic reserves when a single request's rows exceed it (parallel sampling).
    pool_bytes = max(budget.bytes, batch * workload.num_samples * budget.reservation_bytes)
    pool = BlockPool.for_model(model, max_memory=pool_bytes, block_size=BLOCK_SIZE)

    def new_cache():
        cache = PagedCache(config=model.config, pool=pool)
        return cache, cache.release

    return run_static_batches(
        model, workload, budget, backend="paged-generate", batch_size=batch, new_cache=new_cache,
        reserved_bytes=pool.num_blocks * pool.bytes_per_block, attn_implementation=PAGED_ATTENTION,
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
            model, workload, budget, backend=name, batch_size=batch, new_cache=new_cache,
            reserved_bytes=batch * workload.num_samples * budget.reservation_bytes,
        )

    return run


# ----------------------------------------------------------------------------------------- continuous batching
def _engine_live_tokens(requests, block_size: int) -> int:
    """Computed tokens in the blocks the unfinished requests hold, a block shared by a prefix hit counted once."""
    held: dict[int, int] = {}
    for request in requests:
        if request.finished:
            continue
        for index, block_id in enumerate(request.block_ids):
            tokens = min(block_size, request.num_computed - index * block_size)
            held[block_id] = max(held.get(block_id, 0), tokens)
    return sum(tokens for tokens in held.values() if tokens > 0)


def run_engine(model, workload: Workload, budget: Budget) -> RunResult:
    """hf_paged's Engine; each request is added once its arrival time has passed, as `num_samples` engine requests
    (seeded) for a sampled workload."""
    pool = BlockPool.for_model(model, max_memory=budget.bytes, block_size=BLOCK_SIZE)
    n = workload.num_requests
    sampling = dict(temperature=workload.temperature) if workload.sampled else {}
    added = 0  # workload requests added so far
    request_ids = []  # engine request ids, one per sequence, request-major
    busy = []  # (seconds, requests that ran) per step
    live_peak = held_peak = 0
    with attention(model, None):  # the Engine switches to "hf_paged"; give the model back as it was
        engine = Engine(model, pool, max_num_seqs=ENGINE_MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
        start = time.perf_counter()
        while added < n or engine.has_unfinished():
            now = time.perf_counter() - start
            while added < n and workload.requests[added].arrival <= now:
                spec = workload.requests[added]
                for sample in range(workload.num_samples):
                    if workload.sampled:
                        sampling["seed"] = added * workload.num_samples + sample
                    request_ids.append(engine.add_request(list(spec.prompt_ids), max_new_tokens=spec.max_new_tokens,
                                                          ignore_eos=True, **sampling))
                added += 1
            if not engine.has_unfinished():
                _sleep_until(start + workload.requests[added].arrival)
                continue
            ran_before, step_start = engine.stats.running_sum, time.perf_counter()
            engine.step()
            busy.append((time.perf_counter() - step_start, engine.stats.running_sum - ran_before))
            live_tokens = _engine_live_tokens([engine.request(r) for r in request_ids], pool.block_size)
            live_peak = max(live_peak, live_tokens * budget.bytes_per_token)
            held_peak = max(held_peak, pool.num_used_blocks * pool.bytes_per_block)
        wall = time.perf_counter() - start
    requests = [engine.request(r) for r in request_ids]
    failed = {i: r.error for i, r in enumerate(requests) if r.error}
    if failed:
        raise RuntimeError(f"engine: {len(failed)} requests failed: {failed}")
    stats = engine.stats
    return RunResult(
        backend="engine",
        multiple=budget.multiple,
        outputs=[list(r.output_ids) for r in requests],
        first_token=[r.first_token_time - start for r in requests],
        finish=[r.finish_time - start for r in requests],
        wall_s=wall,
        peak_concurrency=stats.peak_running,
        mean_concurrency=sum(seconds * rows for seconds, rows in busy) / wall,
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


def run_peer(model, workload: Workload, budget: Budget) -> RunResult:
    """transformers' continuous batching (the manager `generate_batch` uses), with per-request max_new_tokens.

    The budget is its `num_blocks` (whole-model blocks of `page_size` tokens, the same bytes as our blocks);
    `max_batch_tokens` and `max_requests_per_batch` match the engine's.
    """
    num_blocks = budget.bytes // (budget.bytes_per_token * BLOCK_SIZE)
    cb_config = ContinuousBatchingConfig(
        seed=0,
        page_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=ENGINE_MAX_NUM_SEQS,
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
    with attention(model, "sdpa"), model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=60
    ) as manager:
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        reserved = int(cache.cache_tensor.numel() * cache.cache_tensor.element_size()) if cache is not None else 0
        start = time.perf_counter()
        for index, spec in enumerate(workload.requests):
            _sleep_until(start + spec.arrival)
            manager.add_request(list(spec.prompt_ids), request_id=f"r{index}", max_new_tokens=spec.max_new_tokens,
                                record_timestamps=True, eos_token_id=-1)
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
    return RunResult(
        backend=PEER,
        multiple=budget.multiple,
        outputs=[list(r.generated_tokens) for r in ordered],
        first_token=[r.timestamps[0] - start for r in ordered],
        finish=[r.timestamps[-1] - start for r in ordered],
        wall_s=wall,
        peak_concurrency=max(sum(s <= t < e for s, e in spans) for t, _ in spans),
        mean_concurrency=sum(e - s for s, e in spans) / wall,
        reserved_bytes=reserved or num_blocks * budget.bytes_per_token * BLOCK_SIZE,
        live_bytes_peak=None,
        extra={"num_blocks": num_blocks, "page_size": BLOCK_SIZE},
    )


RUNNERS: dict[str, Callable[..., RunResult]] = {
    "dynamic": run_dynamic,
    "static": run_static,
    "paged-generate": run_paged_generate,
    "engine": run_engine,
    PEER: run_peer,
}
# Runners that call code outside this project: a failure there is reported in the log, not raised.
EXTERNAL = {PEER}


def third_party_backends(registry=None) -> list[str]:
    """Registry backends other than the ones the built-in runners cover."""
    registry = registry if registry is not None else hf_registry.registry
    return [name for name in registry.available_backends() if name not in COVERED_REGISTRY_BACKENDS]


def default_backends(registry=None) -> list[str]:
    return list(BUILTIN_BACKENDS) + third_party_backends(registry)


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process on the machine has used, CPU seconds this process has used); None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system
    except (OSError, ValueError, IndexError):
        return None


def timed_run(runner, model, workload: Workload, budget: Budget) -> RunResult:
    """Run one job and record `extra["other_load"]`: cores that other processes kept busy meanwhile (on average).

    NOTE: CPU timings on a shared machine are only comparable when nothing else runs; this is the evidence.
    """
    before = _cpu_seconds()
    result = runner(model, workload, budget)
    after = _cpu_seconds()
    if before is not None and after is not None and result.wall_s > 0:
        others = (after[0] - before[0]) - (after[1] - before[1])
        result.extra["other_load"] = max(0.0, others) / result.wall_s
    return result


# A run during which other processes kept more than this many cores busy is run again once.
NOISY_LOAD = 0.25


@dataclass
class ServingRun:
    """Everything one `run_serving` measured: the reference outputs and one RunResult per (budget, backend), the
    fastest of the repeats."""

    workload: Workload
    budgets: list[Budget]
    reference: list[list[int]] | None  # None for a sampled workload
    results: list[RunResult]
    failures: dict[str, str] = field(default_factory=dict)  # "backend @ multiple" -> error, external runners only
    repeats: int = 1
    notes: list[str] = field(default_factory=list)


def run_serving(
    model, workload: Workload, multiples, backends=None, *, repeats: int = 1, registry=None, progress: bool = True
) -> ServingRun:
    """Serve `workload` with every backend under every budget multiple (budgets outer, backends inner), `repeats`
    times interleaved so every backend sees the same machine noise; keeps the fastest run of each."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    registry = registry if registry is not None else hf_registry.registry
    backends = list(backends) if backends is not None else default_backends(registry)
    runners = {}
    for name in backends:
        if name in RUNNERS:
            runners[name] = RUNNERS[name]
        elif name in registry.available_backends():
            runners[name] = run_registry_backend(name, registry)
        else:
            valid = list(RUNNERS) + third_party_backends(registry)
            raise ValueError(f"unknown serving backend {name!r}; choose from {', '.join(valid)}")
    budgets = [Budget.for_workload(model, workload, m) for m in multiples]
    reference = reference_outputs(model, workload, progress=progress)
    run = ServingRun(workload, budgets, reference, [], repeats=repeats)
    best: dict[tuple[str, float], RunResult] = {}
    jobs = [(budget, name) for _ in range(repeats) for budget in budgets for name in backends]
    for budget, name in tqdm(jobs, desc="serving runs", disable=not progress):
        key = (name, budget.multiple)
        label = f"{name} @ {budget.multiple:g}x"
        if label in run.failures:
            continue
        try:
            result = timed_run(runners[name], model, workload, budget)
            if result.extra.get("other_load", 0.0) > NOISY_LOAD:
                retry = timed_run(runners[name], model, workload, budget)
                result = retry if retry.wall_s < result.wall_s else result
        except Exception as error:
            if name in RUNNERS and name not in EXTERNAL:
                raise
            run.failures[label] = f"{type(error).__name__}: {error}"
            best.pop(key, None)
            continue
        kept = best.get(key)
        if kept is not None and not workload.sampled and result.outputs != kept.outputs:
            run.notes.append(f"`{label}`: outputs differ between repeats")
        if kept is None or result.wall_s < kept.wall_s:
            best[key] = result
    run.results = [best[(name, b.multiple)] for b in budgets for name in backends if (name, b.multiple) in best]
    return run
