"""`/metrics`: the Engine's state in Prometheus' text exposition format (version 0.0.4)."""

from __future__ import annotations

from .manager import EngineMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, EngineMetrics field)
METRICS = (
    ("hf_paged_requests_running", "gauge", "Requests in the Engine's running batch.", "num_running"),
    ("hf_paged_requests_waiting", "gauge", "Requests queued for admission.", "num_waiting"),
    ("hf_paged_kv_blocks_used", "gauge", "KV cache pool blocks held by requests.", "num_used_blocks"),
    ("hf_paged_kv_blocks_total", "gauge", "KV cache pool blocks.", "num_blocks"),
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
)


def render(metrics: EngineMetrics) -> str:
    lines = []
    for name, kind, help_text, field in METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {getattr(metrics, field)}"]
    return "\n".join(lines) + "\n"
