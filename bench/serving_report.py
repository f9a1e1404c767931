"""Metrics of a serving run (tok/s, latency percentiles, concurrency, KV utilization, greedy agreement), the
markdown sections of SERVING_LOG.md (the plot itself is drawn by bench/plot.py)."""

from __future__ import annotations

from tabulate import tabulate

from .serving import (
    BLOCK_SIZE,
    ENGINE_MAX_NUM_SEQS,
    MAX_NUM_BATCHED_TOKENS,
    NOISY_LOAD,
    PEER,
    STATIC_SLOT_TOKENS,
    Budget,
    RunResult,
    ServingRun,
)
from .workloads import Workload

MIB = 2**20
BASELINE = "dynamic"


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    values = sorted(values)
    if not values:
        return None
    position = (len(values) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def first_difference(output: list[int], reference: list[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts); None when equal."""
    for position, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return position
    return None if len(output) == len(reference) else min(len(output), len(reference))


def concurrency_bound(workload: Workload, budget: Budget) -> float:
    """The memory bound on mean concurrency at `budget`: the budget's bytes over the K/V bytes a sequence holds on
    average while it runs, in whole blocks (in its j-th forward, j = 0 .. outputs - 1, a sequence holds its prompt
    plus j tokens; in a sliding-window layer only the blocks its last query sees: `Budget.paged_bytes`).
    Concurrency x bytes held per sequence cannot pass the budget at any moment.

    It bounds the mean over steps exactly when every sequence runs one forward per output token and holds what it
    counts: no shared blocks (a common prefix, parallel samples), no prompt prefilled in several chunks (an extra
    forward holding less than the prompt), no sliding window still holding a whole prompt during its prefill. The
    time-weighted mean the log reports can also pass it a little when the long steps are those whose rows hold
    few tokens (a prefill step, while its sequences hold only their prompts).
    """
    held = forwards = 0
    for spec in workload.requests:  # parallel samples hold what their request does: the same mean
        prompt = len(spec.prompt_ids)
        held += sum(budget.paged_bytes(prompt + j) for j in range(spec.max_new_tokens))
        forwards += spec.max_new_tokens
    return budget.bytes / (held / forwards)


def summarize(result: RunResult, run: ServingRun) -> dict:
    """One table row: the metrics of one backend under one budget."""
    workload = run.workload
    sequences = workload.sequences  # one spec per generated sequence
    assert [len(output) for output in result.outputs] == [spec.max_new_tokens for spec in sequences], result.backend
    ttft = [first - spec.arrival for first, spec in zip(result.first_token, sequences)]
    tpot = [
        (finish - first) / (spec.max_new_tokens - 1)
        for first, finish, spec in zip(result.first_token, result.finish, sequences)
        if spec.max_new_tokens > 1
    ]
    mismatches = None  # sampled: nothing to compare with
    if run.reference is not None:
        mismatches = [
            {
                "request": index,
                "first_difference": position,
                # the two tokens there (None past the end of the shorter list)
                "token": output[position] if position < len(output) else None,
                "reference_token": reference[position] if position < len(reference) else None,
            }
            for index, (output, reference) in enumerate(zip(result.outputs, run.reference))
            if (position := first_difference(output, reference)) is not None
        ]
    budget = next(b for b in run.budgets if b.multiple == result.multiple)
    return {
        "budget": f"{result.multiple:g}x",
        "backend": result.backend,
        "kv_budget_mib": budget.bytes / MIB,
        "kv_budget_bytes": budget.bytes,
        "wall_s": result.wall_s,
        "output_tok_s": workload.num_output_tokens / result.wall_s,
        "requests_s": workload.num_requests / result.wall_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": 1000 * percentile(tpot, 50) if tpot else None,
        "tpot_p99_ms": 1000 * percentile(tpot, 99) if tpot else None,
        "peak_concurrency": result.peak_concurrency,
        "mean_concurrency": result.mean_concurrency,
        "mean_live": result.mean_live,
        "concurrency_bound": concurrency_bound(workload, budget),
        "reserved_mib": result.reserved_bytes / MIB,
        "reserved_bytes": result.reserved_bytes,
        "live_at_peak_mib": None if result.live_bytes_peak is None else result.live_bytes_peak / MIB,
        "utilization": None if result.live_bytes_peak is None else result.live_bytes_peak / result.reserved_bytes,
        "held_at_peak_mib": None if result.held_bytes_peak is None else result.held_bytes_peak / MIB,
        "other_load": result.extra.get("other_load"),
        "preemptions": result.num_preemptions,
        "wasted_tokens": result.wasted_tokens,
        "num_agree": None if mismatches is None else len(sequences) - len(mismatches),
        "num_sequences": len(sequences),
        "mismatches": mismatches,
        "extra": result.extra,
        "per_request": {"ttft_s": ttft, "finish_s": result.finish},
    }


def summarize_all(run: ServingRun) -> list[dict]:
    """Rows in run order, each with its ratios to the dynamic baseline of the same budget (when it ran)."""
    rows = [summarize(result, run) for result in run.results]
    baselines = {row["budget"]: row for row in rows if row["backend"] == BASELINE}
    for row in rows:
        base = baselines.get(row["budget"])
        row["tok_s_vs_dynamic"] = row["output_tok_s"] / base["output_tok_s"] if base else None
        row["concurrency_vs_dynamic"] = row["mean_concurrency"] / base["mean_concurrency"] if base else None
        row["live_vs_dynamic"] = row["mean_live"] / base["mean_live"] if base else None
        row["concurrency_of_bound"] = row["mean_live"] / row["concurrency_bound"]
        row["bound_vs_dynamic"] = row["concurrency_bound"] / base["mean_concurrency"] if base else None
        row["bound_vs_dynamic_live"] = row["concurrency_bound"] / base["mean_live"] if base else None
    return rows


def describe(run: ServingRun) -> dict:
    """The workload and budget facts the report states, JSON-ready."""
    workload, unit = run.workload, run.budgets[0]
    return {
        "workload": workload.name,
        "description": workload.description,
        "num_requests": workload.num_requests,
        "num_samples": workload.num_samples,
        "temperature": workload.temperature,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "max_prompt_len": workload.max_prompt_len,
        "max_new_tokens": workload.max_new_tokens,
        "reservation_tokens": unit.reservation_tokens,
        "bytes_per_token": unit.bytes_per_token,
        "reservation_bytes": unit.reservation_bytes,
        "sliding_windows": sorted({window for _, window in unit.windows}),
        "num_sliding_layers": len(unit.windows),
        "full_bytes_per_token": unit.full_bytes_per_token,
        "budget_multiples": [b.multiple for b in run.budgets],
        "static_slot_tokens": run.static_slot_tokens,
        "repeats": run.repeats,
        "failures": run.failures,
    }


def _reservation_terms(facts: dict) -> str:
    """What one reservation counts: every layer at the whole sequence, or, with sliding-window layers, the full
    layers at the whole sequence and the sliding ones at the blocks a window spans."""
    if not facts.get("num_sliding_layers"):
        return f"{facts['reservation_tokens']} tokens x {facts['bytes_per_token']} K/V bytes per token"
    windows = "/".join(map(str, facts["sliding_windows"]))
    return (
        f"{facts['reservation_tokens']} tokens x {facts['full_bytes_per_token']} K/V bytes per token in the "
        f"full-attention layers, plus in the {facts['num_sliding_layers']} sliding-window layers (window {windows}) "
        "only the blocks a row's window spans (DynamicCache keeps the last window - 1 tokens there)"
    )


def _bounds(rows: list[dict]) -> str:
    """The concurrency bound of each budget, and its ratio to dynamic's mean when dynamic ran."""
    first_rows = {}
    for row in rows:
        first_rows.setdefault(row["budget"], row)
    return "; ".join(
        f"{budget} {row['concurrency_bound']:.2f} seqs"
        + (
            f" ({row['bound_vs_dynamic']:.2f}x dynamic's mean rows, {row['bound_vs_dynamic_live']:.2f}x its mean live)"
            if row["bound_vs_dynamic"]
            else ""
        )
        for budget, row in first_rows.items()
    )


def engine_ratios(rows: list[dict], engine: str = "engine") -> list[dict]:
    """Per budget where `engine` ran: its tok/s over dynamic's and the peer's (and over dynamic's in each repeat,
    when there were several), its mean live over dynamic's and static's, its mean rows over dynamic's, its
    utilization and greedy agreement (None where a baseline did not run)."""
    by_key = {(row["budget"], row["backend"]): row for row in rows}

    def ratio(row, key, backend):
        base = by_key.get((row["budget"], backend))
        return row[key] / base[key] if base else None

    def each_repeat(row):
        """tok/s over dynamic's, repeat by repeat (every backend serves the same tokens: a ratio of wall times)."""
        base = by_key.get((row["budget"], "dynamic"))
        own = row.get("extra", {}).get("repeat_walls_s") or []
        theirs = (base or {}).get("extra", {}).get("repeat_walls_s") or []
        return [d / e for d, e in zip(theirs, own)] if len(own) == len(theirs) > 1 else None

    return [
        {
            "budget": row["budget"],
            "tok_s_vs_dynamic": row["tok_s_vs_dynamic"],
            "tok_s_vs_dynamic_each": each_repeat(row),
            "tok_s_vs_peer": ratio(row, "output_tok_s", PEER),
            "live_vs_dynamic": row["live_vs_dynamic"],
            "live_vs_static": ratio(row, "mean_live", "static"),
            "rows_vs_dynamic": row["concurrency_vs_dynamic"],
            "utilization": row["utilization"],
            "preemptions": row["preemptions"],
            "agree": None if row["num_agree"] is None else f"{row['num_agree']}/{row['num_sequences']}",
        }
        for row in rows
        if row["backend"] == engine
    ]


def disturbed_notes(rows: list[dict], engine: str = "engine") -> list[str]:
    """One line per budget where `engine` came out slower than dynamic while other processes kept more than
    NOISY_LOAD cores busy during either run: that ratio measures the host, not the backends."""
    by_key = {(row["budget"], row["backend"]): row for row in rows}
    notes = []
    for row in rows:
        base = by_key.get((row["budget"], BASELINE))
        if row["backend"] != engine or base is None or row["tok_s_vs_dynamic"] >= 1:
            continue
        loads = [row["other_load"], base["other_load"]]
        if max((load or 0.0) for load in loads) > NOISY_LOAD:
            notes.append(
                f"`{engine}` at {row['budget']} came out at {row['tok_s_vs_dynamic']:.2f}x dynamic's tok/s while "
                f"other processes kept {_fmt(loads[0], '.2f')} cores busy during its run and {_fmt(loads[1], '.2f')} "
                "during dynamic's: a disturbed timing, not the backends'; run again on an idle machine."
            )
    return notes


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def over_budget(row: dict) -> bool:
    """Whether the backend reserved more K/V memory than its budget (scratch that never holds a request's K/V left
    out): then its row is not at matched memory."""
    scratch = row.get("extra", {}).get("scratch_bytes", 0)
    return row.get("reserved_bytes", 0) - scratch > row.get("kv_budget_bytes", float("inf"))


def _backend_cell(row: dict) -> str:
    return f"{row['backend']} (over budget)" if over_budget(row) else row["backend"]


def over_budget_notes(rows: list[dict], facts: dict) -> list[str]:
    """One line per row whose backend reserved more than the budget, with the bytes it needed."""
    slot = max(facts.get("static_slot_tokens", STATIC_SLOT_TOKENS), facts["reservation_tokens"])
    notes = []
    for row in rows:
        if not over_budget(row):
            continue
        smallest = row.get("extra", {}).get("batch_size") == 1
        detail = ""
        if smallest and row["backend"] == "static":
            detail = f"; its smallest batch, one request in a StaticCache slot of {slot} tokens"
        elif smallest:
            detail = "; its smallest batch, one request"
        notes.append(
            f"`{row['backend']}` at {row['budget']} does not run inside the budget: it reserved "
            f"{row['reserved_bytes']} bytes ({row['reserved_bytes'] / MIB:.2f} MiB{detail}) against the budget's "
            f"{row['kv_budget_bytes']} bytes ({row['kv_budget_bytes'] / MIB:.2f} MiB), so its row is not at "
            "matched memory."
        )
    return notes


def render(serving: dict) -> list[str]:
    """The serving sections of SERVING_LOG.md, from `{"facts": describe(run), "rows": summarize_all(run), ...}`;
    optional keys: `notes` (lines) and `plot` (the PNG's path relative to the log, linked when given)."""
    facts, rows = serving["facts"], serving["rows"]
    slot_setting = facts.get("static_slot_tokens", STATIC_SLOT_TOKENS)
    slot = max(slot_setting, facts["reservation_tokens"])
    throughput = [
        [
            row["budget"],
            _backend_cell(row),
            _fmt(row["output_tok_s"], ".1f"),
            _fmt(row["tok_s_vs_dynamic"], ".2f"),
            _fmt(row["requests_s"], ".2f"),
            _fmt(row["ttft_p50_s"], ".2f"),
            _fmt(row["ttft_p99_s"], ".2f"),
            _fmt(row["tpot_p50_ms"], ".1f"),
            _fmt(row["tpot_p99_ms"], ".1f"),
            _fmt(row["wall_s"], ".1f"),
            _fmt(row["other_load"], ".2f"),
            "n/a (sampled)" if row["num_agree"] is None else f"{row['num_agree']}/{row['num_sequences']}",
        ]
        for row in rows
    ]
    memory = [
        [
            row["budget"],
            _backend_cell(row),
            _fmt(row["kv_budget_mib"], ".2f"),
            row["peak_concurrency"],
            _fmt(row["mean_concurrency"], ".1f"),
            _fmt(row["concurrency_vs_dynamic"], ".2f"),
            _fmt(row["mean_live"], ".1f"),
            _fmt(row["live_vs_dynamic"], ".2f"),
            _fmt(row["concurrency_of_bound"], ".2f"),
            _fmt(row["reserved_mib"], ".2f") + (" > budget" if over_budget(row) else ""),
            _fmt(row["live_at_peak_mib"], ".2f"),
            _fmt(row["utilization"], ".2f"),
            _fmt(row["held_at_peak_mib"], ".2f"),
            row["preemptions"],
            row["wasted_tokens"],
        ]
        for row in rows
    ]
    ratios = [
        [
            r["budget"],
            _fmt(r["tok_s_vs_dynamic"], ".2f"),
            " / ".join(format(x, ".2f") for x in r["tok_s_vs_dynamic_each"] or []) or "-",
            _fmt(r["tok_s_vs_peer"], ".2f"),
            _fmt(r["live_vs_dynamic"], ".2f"),
            _fmt(r["live_vs_static"], ".2f"),
            _fmt(r["rows_vs_dynamic"], ".2f"),
            _fmt(r["utilization"], ".2f"),
            r["preemptions"],
            r["agree"] or "n/a (sampled)",
        ]
        for r in engine_ratios(rows)
    ]
    lines = [
        f"## Serving: `{facts['workload']}` workload at matched KV budgets",
        "",
        f"Workload: {facts['description']}; {facts['num_output_tokens']} output tokens in all. Every request runs",
        "greedy to its own output length (no eos). One worst-case reservation = longest prompt + longest output",
        f"= {facts['max_prompt_len']} + {facts['max_new_tokens']} tokens, rounded up to whole blocks of {BLOCK_SIZE}: "
        + _reservation_terms(facts)
        + f" = {facts['reservation_bytes'] / MIB:.2f} MiB. Budget `Nx` = N reservations, the same for every backend:",
        "",
        "- `dynamic`: static batches of `budget // reservation` requests in arrival order through `generate()` with",
        "  `DynamicCache` (sdpa), left-padded, `max_new_tokens` = the batch's longest output; tokens past a request's",
        "  own length are counted as `wasted`, not as output;",
        f"- `static`: the same with `StaticCache` slots of max({slot_setting}, reservation) = {slot} tokens (a slot is",
        "  sized for the longest context a server accepts), so `budget // slot` rows (at least 1, which can exceed",
        "  the budget: see `reserved`);",
        "- `paged-generate`: the dynamic batches with `PagedCache` on a `BlockPool` of exactly the budget",
        '  ("hf_paged" attention; on a sliding-window model, at least a batch\'s padded prompts whole, which',
        "  `generate()` computes in one forward: see `reserved`);",
        f"- `engine`: `hf_paged.Engine` on a `BlockPool` of exactly the budget (max_num_seqs {ENGINE_MAX_NUM_SEQS}, "
        f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}),",
        "  prefix caching on (its default), requests added when they arrive, stepped until done;",
        "- `engine-optimistic` (when asked for): the same Engine admitting a request when its prompt fits now, with",
        "  no room kept for growth (`decode_reserve_tokens=0`, vLLM's policy); a row (decode or prefill chunk) that",
        "  finds no free block preempts the most recently admitted request, which is recomputed later (its cached",
        "  blocks found again if not evicted);",
        f"- `{PEER}`: transformers' own continuous batching (the manager behind `model.generate_batch`, used",
        "  directly to give each request its own `max_new_tokens`) with `num_blocks` = budget / block bytes,",
        f"  `page_size` {BLOCK_SIZE}, `max_batch_tokens` {MAX_NUM_BATCHED_TOKENS}, block sharing on (its default),",
        "  on sdpa (no switch to flash attention) and without async double-buffering (it would double K/V memory);",
        "  its `reserved` also counts the scratch blocks its cache tensor adds for padding tokens, which never hold",
        "  a request's K/V;",
        "- any other name: a third-party cache backend from `hf_paged.available_backends()`, run like `dynamic`.",
        "",
        *(
            [
                f"Parallel sampling: each request is {facts['num_samples']} sequences (static batches: "
                "`num_return_sequences`, a batch takes `budget // (n x reservation)` requests; engine: n seeded",
                f"requests; `{PEER}`: its `num_return_sequences` forks). Latency and concurrency count sequences.",
                "",
            ]
            if facts["num_samples"] > 1
            else []
        ),
        "TTFT is measured from the request's arrival; static batches stamp every step with a logits-processor",
        "clock, and a request finishes at its own last token (streaming semantics, generous to static batching).",
        "TPOT = (finish - first token) / (outputs - 1). Ratios divide by `dynamic` at the same budget.",
        f"Each (budget, backend) ran {facts['repeats']} time(s), interleaved; the table shows the fastest run.",
        "`other load`: CPU cores other processes kept busy during the run (from /proc/stat); a run above",
        f"{NOISY_LOAD} was run once more and the faster kept. A high value means that row's timings are disturbed.",
        "",
        "### Throughput and latency",
        "",
        tabulate(
            throughput,
            headers=[
                "budget",
                "backend",
                "out tok/s",
                "vs dynamic",
                "req/s",
                "TTFT p50 s",
                "TTFT p99 s",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "wall s",
                "other load",
                "greedy agree",
            ],
            tablefmt="github",
            disable_numparse=True,
        ),
        "",
        "### KV memory and concurrency",
        "",
        "Concurrency, two ways, each a mean weighted by time over the wall time. `mean rows`: sequences each",
        "forward computes (static batches: the batch size, padding rows included; engine: requests run per step).",
        "`mean live`: sequences that still owe tokens, each counted from its first forward to its own last token",
        "(the clock the latency columns use). A static batch's row that has its last token computes padding until",
        "the batch's longest request ends and is not live. Engine rows have no padding (a request retires at its",
        "last token); its `mean live` counts, each step, the requests holding K/V (a prompt waiting for prefill",
        "budget between chunks included) and those the step finished; a request admitted but not started, or",
        f"preempted and waiting to be recomputed, is not live. `{PEER}` counts each request's lifespan.",
        "`reserved`: K/V memory set aside (dynamic: batch x reservation; static: batch x slot; paged/engine/peer:",
        "the pool); a backend that reserved more than the budget is marked `(over budget)` in both tables, its",
        "row is not at matched memory, and the notes give the bytes it needed. `live at peak`: K/V of real tokens",
        "(prompt + the request's own outputs; no padding, no wasted tokens; a shared prefix block counted once) at",
        "the busiest moment; utilization = live / reserved. `held at peak`: pool blocks in use (hf_paged backends,",
        f"padding included). `-`: not observable (`{PEER}` keeps its cache internal).",
        "",
        "`of bound`: mean live over the memory bound on mean concurrency, budget bytes / mean K/V bytes a sequence",
        "holds while it runs (whole blocks, in a sliding-window layer those its window spans; `concurrency_bound` in",
        "bench/serving_report.py). Without shared blocks or chunked prefills no backend passes it on the mean over",
        "steps; the time-weighted mean can pass it a little (long prefill steps hold only prompts, though a sliding",
        f"layer holds a whole prompt chunk then). Bound per budget: {_bounds(rows)}.",
        "",
        tabulate(
            memory,
            headers=[
                "budget",
                "backend",
                "budget MiB",
                "peak seqs",
                "mean rows",
                "vs dynamic",
                "mean live",
                "vs dynamic",
                "of bound",
                "reserved MiB",
                "live at peak MiB",
                "utilization",
                "held at peak MiB",
                "preemptions",
                "wasted tokens",
            ],
            tablefmt="github",
            disable_numparse=True,
        ),
        "",
        *(
            [
                "### The engine against the baselines",
                "",
                "Ratios of the `engine` rows above, budget by budget (`-`: that baseline did not run). `each "
                "repeat`: the engine's tok/s over dynamic's in each of the interleaved repeats (the table keeps "
                "each backend's fastest), the run-to-run spread of the first ratio.",
                "",
                tabulate(
                    ratios,
                    headers=[
                        "budget",
                        "tok/s vs dynamic",
                        "each repeat",
                        f"tok/s vs {PEER}",
                        "live vs dynamic",
                        "live vs static",
                        "rows vs dynamic",
                        "utilization",
                        "preemptions",
                        "greedy agree",
                    ],
                    tablefmt="github",
                    disable_numparse=True,
                ),
                "",
            ]
            if ratios
            else []
        ),
        *(
            [
                "### Throughput and concurrency against budget",
                "",
                "The first two tables as a plot: output tok/s (left) and mean live sequences (right) of each "
                "backend at each budget.",
                "",
                f"![{facts['workload']}: output tok/s and mean live sequences against KV budget]({serving['plot']})",
                "",
            ]
            if serving.get("plot")
            else []
        ),
        "### Greedy agreement with per-request generate()",
        "",
        "Every backend's outputs against each request alone through `generate()` with `DynamicCache` (sdpa).",
        "",
    ]
    mismatched = [row for row in rows if row["mismatches"]]
    if facts["temperature"] > 0:
        lines.append(
            f"Sampled workload (temperature {facts['temperature']:g}): the backends draw from different "
            "generators, so outputs are not compared; every sequence has its full length."
        )
    elif not mismatched:
        lines.append(f"All {len(rows)} runs reproduce every request token for token.")
    for row in mismatched:
        shown = ", ".join(
            f"request {m['request']} at token {m['first_difference']} ({m['token']} for {m['reference_token']})"
            for m in row["mismatches"][:10]
        )
        more = f" (and {len(row['mismatches']) - 10} more)" if len(row["mismatches"]) > 10 else ""
        lines.append(
            f"- `{row['backend']}` at {row['budget']}: {row['num_agree']}/{row['num_sequences']} agree; "
            f"first differences: {shown}{more}"
        )
    notes = [f"- `{key}` failed: {error}" for key, error in facts["failures"].items()]
    notes += [f"- {note}" for note in over_budget_notes(rows, facts) + disturbed_notes(rows)]
    notes += [f"- {note}" for note in serving.get("notes", [])]
    if notes:
        lines += ["", "### Notes", "", *notes]
    lines.append("")
    return lines
