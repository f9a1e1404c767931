"""The serving plot: output tok/s and mean live sequences against KV budget, one line per backend, as a PNG.

matplotlib is an optional extra (`pip install -e '.[plot]'`); without it `plot_serving` returns None and the caller
writes a note in the log instead.
"""

from __future__ import annotations

from pathlib import Path

# Concurrency as live sequences (bench/serving_report.py): static batches' padding rows do not count.
PANELS = (("output_tok_s", "output tok/s"), ("mean_live", "mean live sequences"))


def budget_multiple(row: dict) -> float:
    """The budget multiple of a serving row: its `budget` is written `f"{multiple:g}x"` (bench/serving_report.py)."""
    return float(row["budget"].removesuffix("x"))


def plot_serving(rows: list[dict], path: str | Path, *, title: str) -> Path | None:
    """Two panels side by side, output tok/s and mean live sequences against the budget multiple (log2 axis),
    one line per backend in the rows' order. `rows`: `serving_report.summarize_all(run)`. Returns the PNG's path, or
    None when matplotlib is not installed."""
    try:
        # NOTE: a Figure with an explicit Agg canvas, not pyplot: pyplot keeps global figures and picks a backend
        # for the whole process, and the harness needs neither (no display, nothing left open).
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2)
    multiples = sorted({budget_multiple(row) for row in rows})
    for backend in dict.fromkeys(row["backend"] for row in rows):
        mine = sorted((row for row in rows if row["backend"] == backend), key=budget_multiple)
        for axis, (key, _) in zip(axes, PANELS):
            axis.plot([budget_multiple(row) for row in mine], [row[key] for row in mine], marker="o", label=backend)
    for axis, (_, label) in zip(axes, PANELS):
        axis.set_xscale("log", base=2)
        axis.set_xticks(multiples, [f"{m:g}x" for m in multiples])
        axis.minorticks_off()  # the log axis would otherwise label 3x, 5x, ... between the budgets that ran
        axis.set_xlabel("KV budget (multiples of one worst-case reservation)")
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
    return save(figure, axes, title, path)


# Log scales: the servers differ by more than an order of magnitude.
HTTP_PANELS = (("output_tok_s", "output tok/s"), ("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"))


def plot_http(rows: list[dict], path: str | Path, *, title: str) -> Path | None:
    """Three panels side by side, output tok/s, TTFT p99 and ITL p50 against concurrency, one line per server in the
    rows' order. `rows`: `bench.serve.row_of` rows. Returns the PNG's path, or None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figure = Figure(figsize=(14, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(HTTP_PANELS))
    levels = sorted({row["concurrency"] for row in rows})
    for server in dict.fromkeys(row["server"] for row in rows):
        mine = sorted((row for row in rows if row["server"] == server), key=lambda row: row["concurrency"])
        for axis, (key, _) in zip(axes, HTTP_PANELS):
            points = [(row["concurrency"], row[key]) for row in mine if row[key]]
            if points:
                axis.plot(*zip(*points), marker="o", label=server)
    for axis, (_, label) in zip(axes, HTTP_PANELS):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.minorticks_off()
        axis.set_yscale("log")
        axis.set_xlabel("concurrency (streams in flight)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    return save(figure, axes, title, path)


def save(figure, axes, title: str, path: str | Path) -> Path:
    """Legend on the first panel, the title, and the PNG at `path`."""
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
