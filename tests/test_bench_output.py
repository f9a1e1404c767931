"""Where `python -m bench` writes, and what its report's first lines say: a quick run goes to its output folder
(default bench/results/quick/), never over the committed full-run SERVING_LOG.md at the top of the repository, and
its title says it is a quick run on this host; a backend that reserves more than its budget is marked in its row.

A tiny model and a 6-request burst, serving only; nothing here is timed.
"""

import json
import re

import pytest

from bench import __main__ as harness
from bench import serving, serving_report
from bench.workloads import burst
from tests.models import VOCAB_SIZE, tiny_model

TOP_LEVEL = (harness.ROOT / harness.LOG_NAME, harness.ROOT / "serving_plot_burst.png")


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama", "sdpa", seed=8)  # a private instance: the engine switches its attention
    yield model
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def workload():
    return burst(vocab_size=VOCAB_SIZE, num_requests=6, prompt_lens=(4, 12), output_lens=(3, 8), seed=1)


def _snapshot(paths):
    """(size, mtime in ns, bytes) of each path that exists; None for one that does not."""
    return [
        (path.stat().st_size, path.stat().st_mtime_ns, path.read_bytes()) if path.exists() else None for path in paths
    ]


def test_quick_run_writes_into_its_output_folder_only(model, workload, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "load_model", lambda path, device=None, dtype=None: model)
    monkeypatch.setattr(harness, "make_workload", lambda *args, **kwargs: workload)
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")  # the raw JSONs' default folder
    before = _snapshot(TOP_LEVEL)
    out = tmp_path / "quick"
    argv = ["--quick", "--out", str(out), "--serving-only", "--budgets", "2", "--backends", "dynamic,engine"]
    assert harness.main([*argv, "--repeats", "1", "--no-progress"]) == 0

    assert _snapshot(TOP_LEVEL) == before  # the committed full-run report and plot are untouched
    log = (out / harness.LOG_NAME).read_text()
    title = log.splitlines()[0]
    assert title.startswith("# Serving log: quick run on "), title
    assert harness.host() in title and re.search(r", \d{4}-\d{2}-\d{2}$", title), title
    assert "A quick run (`python -m bench --quick`)" in log and "`make bench-full`" in log
    assert "## Serving: `burst` workload" in log
    served = json.loads((tmp_path / "results" / "quick" / "serving.json").read_text())
    assert served["header"]["command"].startswith("python -m bench --quick --out")
    if served["plot"] is not None:  # matplotlib installed: the plot lies beside the report
        assert (out / "serving_plot_burst.png").exists() and served["plot"] == "serving_plot_burst.png"


def test_output_paths_default_by_size_and_a_quick_run_refuses_the_full_report(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    quick = harness.parse_args([])
    assert quick.out == str(tmp_path / "results" / "quick")
    assert quick.log == str(tmp_path / "results" / "quick" / harness.LOG_NAME)
    assert quick.serving_json == str(tmp_path / "results" / "quick" / "serving.json")
    full = harness.parse_args(["--full"])
    assert full.out == str(tmp_path / "results" / "full") and full.json.endswith("full/cache_report.json")
    # `make bench-full` writes the committed report; `--out .` from the repository root names it.
    assert harness.parse_args(["--full", "--out", str(harness.ROOT)]).log == str(TOP_LEVEL[0])
    with pytest.raises(SystemExit):
        harness.parse_args(["--quick", "--out", str(harness.ROOT)])
    with pytest.raises(SystemExit):
        harness.parse_args(["--static-slot", "0"])


def test_full_title_and_host():
    assert re.fullmatch(r".+ \((\d+ cores, )?\d+ threads\)", harness.host())
    log = harness.render({"title": "Serving log: full run on X, 2030-01-01", "size": "full", "header": {}})
    assert log.startswith("# Serving log: full run on X, 2030-01-01") and "A quick run" not in log


def test_a_backend_over_its_budget_is_marked_in_its_row(model, workload):
    def rows(slot_tokens, backends=("dynamic", "static")):
        run = serving.run_serving(model, workload, [2], backends, progress=False, static_slot_tokens=slot_tokens)
        rows = serving_report.summarize_all(run)
        return rows, "\n".join(serving_report.render({"facts": serving_report.describe(run), "rows": rows}))

    # A 1024-token slot cannot fit a budget of two 32-token reservations: one row needs more than the whole budget.
    (dynamic, static), text = rows(1024)
    assert static["reserved_bytes"] > static["kv_budget_bytes"] == dynamic["reserved_bytes"]
    assert "| static (over budget) " in text and "| dynamic (over budget)" not in text
    assert f"{static['reserved_mib']:.2f} > budget" in text
    assert (
        f"`static` at 2x does not run inside the budget: it reserved {static['reserved_bytes']} bytes "
        f"({static['reserved_mib']:.2f} MiB; its smallest batch, one request in a StaticCache slot of 1024 tokens)"
    ) in text
    assert "slots of max(1024, reservation) = 1024 tokens" in text
    # A slot no longer than the reservation fits as many rows as dynamic's batch: matched memory, nothing marked.
    # transformers' continuous batching adds scratch blocks for padding tokens to the budget's: in `reserved`, yet
    # its K/V capacity is the budget's, so it is not marked.
    (dynamic, static, peer), text = rows(1, ("dynamic", "static", serving.PEER))
    assert static["reserved_bytes"] <= static["kv_budget_bytes"]
    assert peer["reserved_bytes"] - peer["extra"]["scratch_bytes"] <= peer["kv_budget_bytes"] < peer["reserved_bytes"]
    assert "(over budget) |" not in text and "> budget" not in text and "does not run inside" not in text


def test_an_engine_slower_than_dynamic_under_other_load_is_called_disturbed():
    def row(budget, backend, ratio, load):
        return {"budget": budget, "backend": backend, "tok_s_vs_dynamic": ratio, "other_load": load}

    rows = [
        row("2x", "dynamic", 1.0, 0.9),
        row("2x", "engine", 0.8, 0.01),  # slower while dynamic's run was disturbed
        row("4x", "dynamic", 1.0, 0.01),
        row("4x", "engine", 0.9, 0.02),  # slower on a quiet host: no excuse given
        row("8x", "dynamic", 1.0, 0.9),
        row("8x", "engine", 1.2, 0.9),  # faster: nothing to say
    ]
    [note] = serving_report.disturbed_notes(rows)
    assert note.startswith("`engine` at 2x came out at 0.80x dynamic's tok/s") and "0.01 cores" in note
    assert "0.90 during dynamic's" in note
