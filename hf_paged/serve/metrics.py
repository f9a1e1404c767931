"""`/metrics`: the Engine's state in Prometheus' text exposition format (version 0.0.4).

Names follow Prometheus' conventions: `_total` on counters only, base units in the name (`_seconds`), and each
latency a histogram (`_bucket{le=...}`, `_sum`, `_count`), observed on the Engine thread (`manager.py`) from the time
the server took the request.
"""

from __future__ import annotations

from .manager import EngineMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, EngineMetrics field)
METRICS = (
    ("hf_paged_requests_running", "gauge", "Requests in the Engine's running batch.", "num_running"),
    ("hf_paged_requests_waiting", "gauge", "Requests queued for admission.", "num_waiting"),
    ("hf_paged_kv_blocks_used", "gauge", "KV cache pool blocks held by requests.", "num_used_blocks"),
    ("hf_paged_kv_blocks", "gauge", "KV cache pool blocks.", "num_blocks"),
    (
        "hf_paged_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache instead of computed.",
        "prefix_hit_tokens",
    ),
    ("hf_paged_prefill_tokens_total", "counter", "Prompt tokens computed (recomputation included).", "prefill_tokens"),
    ("hf_paged_generation_tokens_total", "counter", "Tokens generated.", "generation_tokens"),
    ("hf_paged_requests_finished_total", "counter", "Requests that ran to their end.", "num_finished"),
    ("hf_paged_requests_aborted_total", "counter", "Requests stopped because their client went away.", "num_aborted"),
    (
        "hf_paged_requests_failed_total",
        "counter",
        "Requests refused by the Engine or failed while running.",
        "num_failed",
    ),
    (
        "hf_paged_preemptions_total",
        "counter",
        "Running requests sent back to the queue to free blocks (computed again later).",
        "num_preemptions",
    ),
)
# (name, help, EngineMetrics.latencies key)
HISTOGRAMS = (
    ("hf_paged_time_to_first_token_seconds", "From the request to its first token.", "time_to_first_token"),
    ("hf_paged_inter_token_latency_seconds", "Between two tokens of one request.", "inter_token_latency"),
    ("hf_paged_e2e_request_latency_seconds", "From the request to its last token.", "e2e_request_latency"),
    ("hf_paged_request_queue_time_seconds", "From the request to its admission.", "request_queue_time"),
)


def render(metrics: EngineMetrics) -> str:
    lines = []
    for name, kind, help_text, field in METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {getattr(metrics, field)}"]
    for name, help_text, key in HISTOGRAMS:
        histogram = metrics.latencies[key]
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip((*histogram.bounds, "+Inf"), histogram.cumulative()):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines += [f"{name}_sum {histogram.total}", f"{name}_count {histogram.count}"]
    return "\n".join(lines) + "\n"
