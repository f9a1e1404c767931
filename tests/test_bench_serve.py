"""`python -m bench.serve`'s report: its rows, ratios and the SERVING_LOG.md section it owns."""

from __future__ import annotations

import argparse

import pytest

from bench import serve


def row(server: str, concurrency: int, tok_s: float, ttft_p99: float) -> dict:
    return {
        "server": server,
        "concurrency": concurrency,
        "output_tok_s": tok_s,
        "requests_s": tok_s / 64,
        "ttft_p50_ms": ttft_p99 / 2,
        "ttft_p99_ms": ttft_p99,
        "itl_p50_ms": 1000 / tok_s,
        "itl_p99_ms": 2000 / tok_s,
        "aiperf_cpu": 0.25,
        "rss_mib": 812.0,
    }


ROWS = [
    row("transformers", 16, 10.0, 90_000.0),
    row("transformers-cb", 16, 25.0, 6_000.0),
    row("hf-paged", 16, 300.0, 800.0),
]


def test_the_table_gives_throughput_and_ttft_ratios_from_the_same_run():
    args = argparse.Namespace(quick=False, concurrency=[16], max_memory="128MiB", level_seconds=150)
    report = serve.render(ROWS, args, serve.Workload(), 512, {"a": "same", "b": "same"}, "plot.png")
    lines = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    assert lines["transformers"].endswith("| 0.25 | 812 | 30.00x | 112.50x |")  # 300 / 10 tok/s; 90,000 / 800 ms
    assert lines["transformers-cb"].endswith("| 12.00x | 7.50x |")
    assert lines["hf-paged"].endswith("| 1.00x | 1.00x |")
    assert "identical on every server" in report and "](plot.png)" in report
    differing = serve.render(ROWS, args, serve.Workload(), 512, {"a": "one", "b": "two"}, None)
    assert "DIFFERS" in differing and "- b: 'two'" in differing and "![" not in differing


def test_the_http_section_is_replaced_in_place_and_kept_by_the_main_benchmark():
    log = "# Serving log\n\n## Serving\n\nrows\n"
    once = serve.with_section(log, "## HTTP serving\n\nfirst\n")
    assert once.startswith(log) and serve.http_section(once) == "## HTTP serving\n\nfirst\n"
    twice = serve.with_section(once + "\n## After\n", "## HTTP serving\n\nsecond\n")
    assert twice.count(serve.HTTP_BEGIN) == 1 and "first" not in twice and twice.endswith("## After\n")
    assert serve.http_section(twice) == "## HTTP serving\n\nsecond\n"
    # `python -m bench` renders a new log and carries the section over (bench/__main__.py)
    rewritten = serve.with_section("# Serving log\n\nnew rows\n", serve.http_section(twice))
    assert "new rows" in rewritten and serve.http_section(rewritten) == "## HTTP serving\n\nsecond\n"
    assert serve.http_section(log) is None


def test_the_plot_has_a_line_per_server(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plot import plot_http

    path = plot_http(ROWS + [row("hf-paged", 32, 400.0, 900.0)], tmp_path / "http.png", title="t")
    assert path.exists() and path.stat().st_size > 10_000


def test_model_serves_a_checkpoint_of_ones_own(tmp_path):
    """`--model DIR` instead of the embedded model: a directory with a config and a tokenizer, else one line."""
    args = serve.parse_args(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a checkpoint directory .no config.json or tokenizer_config.json"):
        serve.model_directory(args, tmp_path / "work")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert serve.model_directory(args, tmp_path / "work") == tmp_path.resolve()
    assert serve.parse_args([]).model is None
    args = argparse.Namespace(quick=True, concurrency=[1], max_memory="64MiB", level_seconds=10, model=tmp_path)
    report = serve.render(ROWS, args, serve.Workload(), 64, {"a": "same"}, None)
    assert f"--model {tmp_path}`" in report
