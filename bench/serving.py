"""Serving benchmark: one workload served by each backend under the same KV budget, timed request by request.

The KV budget is `multiple x one worst-case reservation`, where a reservation is the longest prompt plus the longest
output of the workload, in tokens (rounded up to whole blocks, so a paged row of that length fits), times the K/V
bytes of one token. Backends:

    dynamic            static batches of `budget // reservation` requests through generate() + DynamicCache
    static             the same with StaticCache slots of max(slot, reservation) tokens (`static_slot_tokens`,
                       default 1024): fewer rows fit
    paged-generate     the same batches as dynamic, PagedCache on a BlockPool of the budget
    engine             hf_paged's continuous-batching Engine on a BlockPool of the budget
    engine-optimistic  (opt-in, not in the default list) the Engine with vLLM's admission: admit what fits now,
                       preempt and recompute the most recently admitted request when a row
                       finds no free block
    hf-generate-batch  transformers' own continuous batching (the manager behind `generate_batch`), the budget
                       given as its `num_blocks` of `page_size` 16
    <plugin name>      any third-party cache backend: the dynamic batches on `create_cache(name, model)`

A static batch always takes at least one request, so at a budget below one request's rows (parallel sampling, or a
StaticCache slot longer than the budget) the static-batch backends reserve more than the budget;
`RunResult.reserved_bytes` says how much, and the report marks such a row `(over budget)`.
Every run returns a `RunResult` (outputs and per-sequence times); `bench/serving_report.py` turns them into metrics.
The runners live in `bench/static_batches.py` and `bench/continuous.py`; what they share, in `bench/runs.py`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_paged import registry as hf_registry

from .continuous import run_engine, run_engine_optimistic, run_peer
from .runs import (  # noqa: F401  (re-exported: the harness's public names live here)
    BLOCK_SIZE,
    ENGINE_MAX_NUM_SEQS,
    MAX_NUM_BATCHED_TOKENS,
    OPTIMISTIC,
    PAD_TOKEN_ID,
    PEER,
    STATIC_SLOT_TOKENS,
    Budget,
    RunResult,
    attention,
    generation_config,
)
from .static_batches import (  # noqa: F401
    dynamic_batch_size,
    run_dynamic,
    run_paged_generate,
    run_registry_backend,
    run_static,
    run_static_batches,
)
from .workloads import RequestSpec, Workload

BUILTIN_BACKENDS = ("dynamic", "static", "paged-generate", "engine", PEER)
# Registry backends that the built-in runners above already cover.
COVERED_REGISTRY_BACKENDS = ("dynamic", "static", "paged")


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


RUNNERS: dict[str, Callable[..., RunResult]] = {
    "dynamic": run_dynamic,
    "static": run_static,
    "paged-generate": run_paged_generate,
    "engine": run_engine,
    PEER: run_peer,
    OPTIMISTIC: run_engine_optimistic,  # opt-in: not in BUILTIN_BACKENDS, so `--backends` must name it
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


def warm_up(model, workload: Workload, runners: dict[str, Callable[..., RunResult]]) -> None:
    """One untimed run of every backend on two short requests (16 prompt tokens, 4 new ones), so the first timed
    run does not pay for first-use work: Triton compiling its kernels on CUDA, allocator and thread-pool start-up.

    NOTE: a Triton kernel compiles again for each new value of a compile-time constant. The decode kernel's split
    count (from the batch and the context) is a power of two, so at most 7 variants exist, and the block-table
    stride is not specialized; a timed CUDA run with long contexts may still compile a split variant the warm-up
    did not meet, once. `--repeats 2` keeps the faster of two runs.
    """
    requests = tuple(RequestSpec(spec.prompt_ids[:16], min(spec.max_new_tokens, 4)) for spec in workload.requests[:2])
    tiny = replace(workload, requests=requests)
    budget = Budget.for_workload(model, tiny, 2)
    for name, runner in runners.items():
        try:
            runner(model, tiny, budget)
        except Exception:
            if name in RUNNERS and name not in EXTERNAL:
                raise
            # an external backend's failure is reported by its timed run


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
    static_slot_tokens: int = STATIC_SLOT_TOKENS  # the static backend's slot, before max(slot, reservation)


def run_serving(
    model,
    workload: Workload,
    multiples,
    backends=None,
    *,
    repeats: int = 1,
    registry=None,
    progress: bool = True,
    static_slot_tokens: int = STATIC_SLOT_TOKENS,
) -> ServingRun:
    """Serve `workload` with every backend under every budget multiple (budgets outer, backends inner), `repeats`
    times interleaved so every backend sees the same machine noise; keeps the fastest run of each, with every
    repeat's wall time in its `extra["repeat_walls_s"]` (the report's run-to-run spread). The static backend's
    slots hold max(`static_slot_tokens`, reservation) tokens."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    registry = registry if registry is not None else hf_registry.registry
    backends = list(backends) if backends is not None else default_backends(registry)
    runners = {}
    for name in backends:
        if name == "static":
            runners[name] = functools.partial(run_static, slot_tokens=static_slot_tokens)
        elif name in RUNNERS:
            runners[name] = RUNNERS[name]
        elif name in registry.available_backends():
            runners[name] = run_registry_backend(name, registry)
        else:
            valid = list(RUNNERS) + third_party_backends(registry)
            raise ValueError(f"unknown serving backend {name!r}; choose from {', '.join(valid)}")
    budgets = [Budget.for_workload(model, workload, m) for m in multiples]
    reference = reference_outputs(model, workload, progress=progress)
    warm_up(model, workload, runners)
    run = ServingRun(workload, budgets, reference, [], repeats=repeats, static_slot_tokens=static_slot_tokens)
    best: dict[tuple[str, float], RunResult] = {}
    walls: dict[tuple[str, float], list[float]] = {}  # every repeat's wall time, in run order
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
        walls.setdefault(key, []).append(result.wall_s)
        kept = best.get(key)
        if kept is not None and not workload.sampled and result.outputs != kept.outputs:
            run.notes.append(f"`{label}`: outputs differ between repeats")
        if kept is None or result.wall_s < kept.wall_s:
            best[key] = result
    run.results = [best[(name, b.multiple)] for b in budgets for name in backends if (name, b.multiple) in best]
    for result in run.results:
        result.extra["repeat_walls_s"] = walls[(result.backend, result.multiple)]
    note = recheck_reference(model, workload, reference, run.results, progress=progress)
    if note:
        run.notes.append(note)
    return run


# At most this many differing requests get their reference computed again (the first ones).
MAX_RECHECKED = 8


def recheck_reference(
    model, workload: Workload, reference: list[list[int]] | None, results: list[RunResult], *, progress: bool = True
) -> str | None:
    """When some backend's greedy output differs from `reference`, compute the reference of those requests (the
    first `MAX_RECHECKED`) once more and say whether it reproduces: a reference that changes between two
    computations in one process points at the host (or the reference path), not at the backends. None when every
    output agrees (or nothing is compared)."""
    if reference is None:
        return None
    differing = sorted({i for result in results for i, (a, b) in enumerate(zip(result.outputs, reference)) if a != b})
    if not differing:
        return None
    # NOTE: bounded, so a bfloat16 run where rows round differently (many differences, none a bug) stays short.
    differing = differing[:MAX_RECHECKED]
    again = reference_outputs(
        model, replace(workload, requests=tuple(workload.requests[i] for i in differing)), progress=progress
    )
    changed = [i for i, output in zip(differing, again) if output != reference[i]]
    shown = ", ".join(map(str, differing))
    if not changed:
        return (
            f"reference recomputed for request(s) {shown}: it reproduces (the backends' runs computed something else)"
        )
    return (
        f"reference recomputed for request(s) {shown}: it changed for {', '.join(map(str, changed))}; "
        "per-request generate() itself did not reproduce on this host, so those differences are not the backends'"
    )
