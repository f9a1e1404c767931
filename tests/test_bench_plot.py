"""The serving plot (bench/plot.py) and how `python -m bench` links it from the log: a PNG from fake rows, then the
harness's own main() on a tiny model with and without matplotlib.

Nothing here is timed. Tests that draw need matplotlib (the `plot` extra, also in `dev`) and skip without it.
"""

import argparse
import json
import sys

import pytest

from bench import __main__ as harness
from bench.plot import budget_multiple, plot_serving
from bench.workloads import burst
from tests.models import VOCAB_SIZE, tiny_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BACKENDS = ("dynamic", "static", "engine")


def _fake_rows() -> list[dict]:
    """What the plot reads of `serving_report.summarize_all`: budget, backend, output tok/s, mean live sequences."""
    return [
        {"budget": f"{m:g}x", "backend": backend, "output_tok_s": 10.0 * m * (i + 1), "mean_live": m * (i + 1.5)}
        for m in (2, 4, 8, 16)
        for i, backend in enumerate(BACKENDS)
    ]


def _assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), data[:8]
    assert len(data) > 10_000  # two panels with lines, labels and a legend, not an empty canvas


def _block_matplotlib(monkeypatch):
    # A None entry in sys.modules makes `import matplotlib` (and its submodules) raise ImportError.
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_budget_multiple_reads_the_row_label():
    assert [budget_multiple({"budget": label}) for label in ("2x", "4.5x", "16x")] == [2, 4.5, 16]


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_serving(_fake_rows(), tmp_path / "nested" / "plot.png", title="Serving: burst workload on cpu")
    assert path == tmp_path / "nested" / "plot.png"
    _assert_png(path)


def test_plot_without_matplotlib_is_none(tmp_path, monkeypatch):
    _block_matplotlib(monkeypatch)
    assert plot_serving(_fake_rows(), tmp_path / "plot.png", title="t") is None
    assert not (tmp_path / "plot.png").exists()


def test_plot_link_is_relative_to_the_log(tmp_path):
    pytest.importorskip("matplotlib")
    args = argparse.Namespace(log=str(tmp_path / "LOG.md"), plot=None, workload="poisson")
    assert harness.draw_plot(_fake_rows(), args, "cpu") == "serving_plot_poisson.png"
    args.plot = str(tmp_path / "plots" / "mine.png")
    assert harness.draw_plot(_fake_rows(), args, "cpu") == "plots/mine.png"
    _assert_png(tmp_path / "plots" / "mine.png")


@pytest.fixture
def tiny_harness(tmp_path, monkeypatch):
    """`python -m bench` on a tiny model and a 6-request burst, serving only, writing into tmp_path."""
    model = tiny_model("llama", "sdpa", seed=6)  # a private instance: the engine switches its attention
    monkeypatch.setattr(harness, "load_model", lambda path, device=None, dtype=None: model)
    workload = burst(vocab_size=VOCAB_SIZE, num_requests=6, prompt_lens=(4, 12), output_lens=(3, 8), seed=1)
    monkeypatch.setattr(harness, "make_workload", lambda *args, **kwargs: workload)

    def main():
        argv = [
            "--serving-only",
            "--budgets",
            "2,4",
            "--backends",
            "dynamic,engine",
            "--repeats",
            "1",
            "--no-progress",
            "--log",
            str(tmp_path / "LOG.md"),
            "--serving-json",
            str(tmp_path / "serving.json"),
        ]
        assert harness.main(argv) == 0
        return (tmp_path / "LOG.md").read_text(), json.loads((tmp_path / "serving.json").read_text())

    return main


def test_harness_writes_the_plot_and_links_it(tiny_harness, tmp_path):
    pytest.importorskip("matplotlib")
    log, served = tiny_harness()
    _assert_png(tmp_path / "serving_plot_burst.png")
    assert served["plot"] == "serving_plot_burst.png"
    assert "### Throughput and concurrency against budget" in log
    assert "](serving_plot_burst.png)" in log
    assert harness.NO_MATPLOTLIB not in log


def test_harness_without_matplotlib_writes_a_note(tiny_harness, tmp_path, monkeypatch):
    _block_matplotlib(monkeypatch)
    log, served = tiny_harness()
    assert not (tmp_path / "serving_plot_burst.png").exists()
    assert served["plot"] is None and harness.NO_MATPLOTLIB in served["notes"]
    assert f"- {harness.NO_MATPLOTLIB}" in log and "![" not in log
    assert "### Throughput and latency" in log  # the rest of the report is still there
