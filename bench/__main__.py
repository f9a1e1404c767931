"""`python -m bench`: the main job. Runs the serving benchmark, then the cache report, on the embedded default model
(or `--model PATH`) and writes SERVING_LOG.md and a plot of the serving run (needs matplotlib, the `plot` extra) into
`--out DIR`, and JSONs of raw results into bench/results/quick/ or bench/results/full/ (git-ignored).

    python -m bench --quick        # a few minutes on 2 CPU cores; report in bench/results/quick/
    python -m bench --full --out . # the numbers committed in SERVING_LOG.md at the top of the repository
    python -m bench --budgets 2,4 --backends dynamic,engine --serving-only
    python -m bench --workload poisson --rate 2     # also: shared-prefix, long, parallel-sampling
    python -m bench --layers mixed --serving-only   # the embedded sizes with sliding-window layers
    python -m bench --tp 2 --serving-only           # a tensor-parallel model on 2 ranks (bench/parallel.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from tabulate import tabulate

from hf_paged import PAGED_ATTENTION

from . import cache_report, parallel, serving, serving_report
from .host import host
from .linear import LINEARS, describe_linear, pick_linear, use_linear
from .models import LAYERS, LAYERS_HELP, embedded_model, load_model, mixed_window_model, sliding_window_model
from .plot import plot_serving
from .runs import STATIC_SLOT_TOKENS, budgets_arg
from .serve import http_section, with_section
from .workloads import WORKLOADS, make_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOG_NAME = "SERVING_LOG.md"
# Default KV budgets (multiples of one worst-case reservation) and StaticCache slot (tokens) per size. A static slot
# is sized for the longest context a server accepts, a power of two above the workload's longest request (full: 1024
# for 624 tokens; quick: 256 for 192), so the static baseline's smallest batch fits the smallest budget and every
# backend is compared at the same K/V memory.
BUDGETS = {"quick": [2.0, 4.0], "full": [2.0, 4.0, 8.0, 16.0]}
STATIC_SLOTS = {"quick": 256, "full": STATIC_SLOT_TOKENS}
EMBEDDED = {
    "full": "embedded Llama-style",
    "sliding": "embedded sizes, Mistral-style, every layer sliding (window 256)",
    "mixed": "embedded sizes, Gemma3-style, 5 sliding (window 256) : 1 full layers",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_MATPLOTLIB = "matplotlib is not installed: no plot was drawn (`pip install -e '.[plot]'`)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (default)")
    size.add_argument(
        "--full",
        action="store_true",
        help="full sizes: serving workloads about 3x larger, 4 budgets; cache report prompt 1024, contexts 512, 4096",
    )
    parser.add_argument("--model", default=None, help="a checkpoint path for from_pretrained (default: embedded model)")
    parser.add_argument("--layers", default="full", choices=LAYERS, help=LAYERS_HELP + "; not with --model")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="model and KV dtype (default: the checkpoint's; the embedded model: float32 on cpu, "
        "bfloat16 on cuda). Compare greedy agreement in float32: in bfloat16, rows packed differently "
        "round differently",
    )
    parser.add_argument(
        "--linear",
        default="auto",
        choices=LINEARS,
        help="how CPU float32 linear layers compute, for every backend alike (default: auto, for each "
        "row count up to 16 the faster of stock F.linear and weight-major W @ x.T, timed on this host "
        "at startup; see bench/linear.py)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"folder for the report ({LOG_NAME}) and its plot (default: bench/results/quick, or bench/results/full "
        f"with --full; `make bench-full` passes `--out .`, the committed {LOG_NAME})",
    )
    parser.add_argument("--log", default=None, help=f"the markdown report's path (default: --out/{LOG_NAME})")
    parser.add_argument(
        "--json", default=None, help="the cache report's raw JSON (default: bench/results/SIZE/cache_report.json)"
    )
    parser.add_argument(
        "--serving-json", default=None, help="the serving run's raw JSON (default: bench/results/SIZE/serving.json)"
    )
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG of tok/s and concurrency against budget (needs matplotlib; "
        "default: serving_plot_WORKLOAD.png next to --log)",
    )
    parser.add_argument(
        "--workload",
        default="burst",
        choices=WORKLOADS,
        help="serving workload (default: burst; see bench/workloads.py)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="poisson arrival rate in requests/s (default: quick 4, full 1)"
    )
    parser.add_argument(
        "--budgets",
        type=budgets_arg,
        default=None,
        help="KV budgets as multiples of one worst-case reservation (default quick 2,4; full 2,4,8,16)",
    )
    parser.add_argument(
        "--static-slot",
        type=int,
        default=None,
        help="the static backend's StaticCache slot in tokens, at least one reservation (default quick 256, "
        f"full {STATIC_SLOT_TOKENS})",
    )
    parser.add_argument(
        "--backends",
        type=_names,
        default=None,
        help=f"serving backends, comma-separated (default: all: {', '.join(serving.BUILTIN_BACKENDS)} "
        "and any third-party cache backend; opt-in: engine-optimistic, the Engine with vLLM's admission)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="serving runs per backend and budget, interleaved; the fastest is kept (default 2)",
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--serving-only", action="store_true", help="skip the cache report (the log then lacks it)")
    only.add_argument(
        "--cache-only", action="store_true", help="only the cache report (PagedCache under generate()), no serving run"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: relaunches itself under torchrun with the model loaded with tp_plan='auto' "
        f"(serving only; backends {', '.join(parallel.TP_BACKENDS)}; see bench/parallel.py) (default: 1)",
    )
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be a positive number of ranks, got {args.tp}")
    if args.tp > 1:
        refused = [name for name in args.backends or [] if name not in parallel.TP_BACKENDS]
        if refused:
            parser.error(
                f"--tp runs backends {', '.join(parallel.TP_BACKENDS)}; {', '.join(refused)} cannot run sharded"
            )
        if args.cache_only:
            parser.error("--tp runs the serving benchmark only: the cache report compares single-device caches")
        args.backends = args.backends or list(parallel.TP_BACKENDS)
        args.serving_only = True  # the cache report compares single-device caches
        args.linear = "torch"  # weight-major linears replace the sharded layers' matmul
    if args.rate is not None and args.workload != "poisson":
        parser.error(f"--rate applies to --workload poisson, not {args.workload}")
    if args.model is not None and args.layers != "full":
        parser.error(f"--layers {args.layers} applies to the embedded model; a checkpoint has its own layers")
    if args.static_slot is not None and args.static_slot < 1:
        parser.error(f"--static-slot must be a positive number of tokens, got {args.static_slot}")
    args.size = "full" if args.full else "quick"
    args.out = args.out or str(RESULTS / args.size)
    args.log = args.log or str(Path(args.out) / LOG_NAME)
    args.json = args.json or str(RESULTS / args.size / "cache_report.json")
    args.serving_json = args.serving_json or str(RESULTS / args.size / "serving.json")
    if args.size == "quick" and Path(args.log).resolve() == ROOT / LOG_NAME:
        parser.error(f"a quick run does not overwrite the full run's {LOG_NAME}; pass another --out")
    if args.cache_only and Path(args.log).resolve() == ROOT / LOG_NAME:
        parser.error(f"a --cache-only run does not overwrite {LOG_NAME} (it has no serving run); pass another --log")
    return args


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = 0
    if args.tp > 1:
        if parallel.launched_ranks() == 1:
            return parallel.relaunch(args.tp, list(argv if argv is not None else sys.argv[1:]))
        rank = parallel.init_ranks(args.tp)
        if rank != 0:  # rank 0 reports; the others run the same steps
            args.no_progress = True
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of this rank's process)
        dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if torch.cuda.is_available() else None)
        whole = None if args.model else embedded_model(args.layers, device="cpu", dtype=dtype)
        model = parallel.load_sharded(args.model, whole, dtype)
    elif args.model is not None:
        model = load_model(args.model, device=args.device, dtype=DTYPES.get(args.dtype))
    else:
        model = embedded_model(args.layers, device=args.device, dtype=DTYPES.get(args.dtype))
    weight_major_rows, calibration = pick_linear(model, args.linear)
    started = time.time()
    device = str(model.device) + (
        f" ({torch.cuda.get_device_name(model.device)})" if model.device.type == "cuda" else ""
    )
    if args.tp > 1:
        device += f", tensor parallel over {args.tp} ranks"
    print(f"model: {args.model or EMBEDDED[args.layers]} on {model.device}, {model.dtype}", flush=True)

    results = {}
    if not args.cache_only:
        results["serving"] = run_serving_part(model, args, device, rank)
    if rank != 0:  # the other tensor-parallel ranks ran the same steps; rank 0 reports
        return 0
    if not args.serving_only:
        results.update(run_cache_report(model, args, weight_major_rows))

    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    header = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{host()}, {torch.get_num_threads()} torch threads, {platform.platform()}",
        "device": device,
        "versions": (
            f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
        ),
        "model": args.model or f"{EMBEDDED[args.layers]} (bench/models.py), random weights",
        "dtype": str(model.dtype).removeprefix("torch."),
        "linear": describe_linear(args.linear, weight_major_rows, calibration),
        "wall_seconds": round(time.time() - started, 1),
    }
    accelerator = "" if model.device.type == "cpu" else f" with {device}"
    title = f"Serving log: {args.size} run on {host()}{accelerator}, {time.strftime('%Y-%m-%d', time.gmtime(started))}"
    results = {"title": title, "size": args.size, "header": header, **results}
    served = {"header": header, **results["serving"]} if "serving" in results else None
    for path, content in ((args.serving_json, served), (args.json, _cache_part(results))):
        if content is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(content, indent=2))
    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    text = render(results)
    http = http_section(log.read_text()) if log.exists() else None  # `python -m bench.serve`'s table stays
    log.write_text(text if http is None else with_section(text, http))
    written = [args.log] + ([] if args.cache_only else [args.serving_json]) + ([] if args.serving_only else [args.json])
    print("wrote " + ", ".join(written))
    return 0


def run_serving_part(model, args, device: str, rank: int = 0) -> dict | None:
    """The serving benchmark on `args.workload` at every budget, its table printed and its plot drawn; None on a
    tensor-parallel rank other than 0, which runs the same steps and reports nothing."""
    workload = make_workload(args.workload, vocab_size=model.config.vocab_size, full=args.full, rate=args.rate)
    budgets = args.budgets or BUDGETS[args.size]
    repeats = args.repeats or 2
    static_slot = args.static_slot or STATIC_SLOTS[args.size]
    run = serving.run_serving(
        model,
        workload,
        budgets,
        args.backends,
        repeats=repeats,
        progress=not args.no_progress,
        static_slot_tokens=static_slot,
    )
    if rank != 0:
        return None
    rows = serving_report.summarize_all(run)
    print(_serving_table(rows), flush=True)
    plot = draw_plot(rows, args, device)
    notes = run.notes + ([] if plot else [NO_MATPLOTLIB])
    return {"facts": serving_report.describe(run), "rows": rows, "notes": notes, "plot": plot}


def draw_plot(rows: list[dict], args: argparse.Namespace, device: str) -> str | None:
    """The serving plot at `--plot`, by default next to the log; returns its path relative to the log's folder (what
    the log's image link needs), or None when matplotlib is not installed."""
    log_dir = Path(args.log).resolve().parent
    path = Path(args.plot) if args.plot else log_dir / f"serving_plot_{args.workload}.png"
    size = getattr(args, "size", None)
    run = f", {size} run" if size else ""
    written = plot_serving(rows, path, title=f"Serving: {args.workload} workload on {device}{run}")
    print(f"wrote {written}" if written else NO_MATPLOTLIB, flush=True)
    return None if written is None else Path(os.path.relpath(written.resolve(), log_dir)).as_posix()


def _serving_table(rows: list[dict]) -> str:
    keys = [
        "budget",
        "backend",
        "output_tok_s",
        "tok_s_vs_dynamic",
        "mean_concurrency",
        "mean_live",
        "utilization",
        "preemptions",
        "num_agree",
    ]
    return tabulate([{key: row[key] for key in keys} for row in rows], headers="keys", floatfmt=".2f")


def _cache_part(results: dict) -> dict | None:
    if "demo" not in results:
        return None
    return {key: value for key, value in results.items() if key != "serving"}


def run_cache_report(model, args, weight_major_rows: frozenset[int]) -> dict:
    """The cache report (PagedCache under plain generate()): demo, KV bytes held, sliding window, decode speed."""
    sizes = (
        dict(
            prompt_len=1024,
            max_new_tokens=64,
            contexts=[512, 4096],
            num_steps=32,
            repeats=5,
            sliding_prompt_len=3584,
            sliding_new_tokens=512,
        )
        if args.full
        else dict(
            prompt_len=256,
            max_new_tokens=32,
            contexts=[256, 1024],
            num_steps=16,
            repeats=2,
            sliding_prompt_len=448,
            sliding_new_tokens=64,
        )
    )
    demo = cache_report.demo(model)
    print(f"demo: identical={demo['identical']}", flush=True)
    memory = cache_report.kv_bytes_held(
        model,
        prompt_len=sizes["prompt_len"],
        max_new_tokens=sizes["max_new_tokens"],
        attentions=("sdpa", PAGED_ATTENTION),
    )
    print(tabulate(memory, headers="keys", floatfmt=".3f"), flush=True)
    dtype = DTYPES.get(args.dtype)  # None: the window models' own default
    window_models = [
        sliding_window_model(256, device=args.device, dtype=dtype),
        mixed_window_model(256, device=args.device, dtype=dtype),
    ]
    for window_model in window_models:
        use_linear(window_model, "weight-major", weight_major_rows=weight_major_rows)
    sliding = [
        row
        for window_model in window_models
        for row in cache_report.sliding_window_bytes(
            window_model, prompt_len=sizes["sliding_prompt_len"], max_new_tokens=sizes["sliding_new_tokens"]
        )
    ]
    print(tabulate(sliding, headers="keys", floatfmt=".3f"), flush=True)
    speed = cache_report.decode_speed(
        model,
        batch_sizes=[1, 4, 16],
        contexts=sizes["contexts"],
        num_steps=sizes["num_steps"],
        repeats=sizes["repeats"],
    )
    print(tabulate(speed, headers="keys", floatfmt=".2f"), flush=True)
    return {"demo": demo, "kv_bytes_held": memory, "sliding_window_bytes": sliding, "decode_speed": speed}


def render(results: dict) -> str:
    """SERVING_LOG.md: the title, the header, the serving sections (when run), then the cache report (when run).
    A quick run says so under its title and points to the full run's report."""
    lines = [f"# {results.get('title', 'Serving log')}", ""]
    if results.get("size") == "quick":
        lines += [
            "A quick run (`python -m bench --quick`): the small workload sizes, a first look in a few minutes. The",
            f"full run's report, at the sizes the project's results quote, is the committed {LOG_NAME} at the top of",
            "the repository (`make bench-full`).",
            "",
        ]
    lines += [f"- {key}: `{value}`" for key, value in results["header"].items()]
    lines.append("")
    if "serving" in results:
        lines += serving_report.render(results["serving"])
    if "demo" in results:
        lines += render_cache_report(results)
    return "\n".join(lines)


def render_cache_report(results: dict) -> list[str]:
    demo = results["demo"]
    lines = [
        "## PagedCache under plain generate()",
        "",
        "Greedy output of one prompt with each cache (first tokens), and the K/V bytes each holds afterwards:",
        "",
        tabulate(
            [
                ["DynamicCache", demo["dynamic_tokens"][:8], demo["dynamic_kv_bytes"]],
                [
                    f"PagedCache (block_size {demo['paged_block_size']})",
                    demo["paged_tokens"][:8],
                    demo["paged_kv_bytes"],
                ],
            ],
            headers=["cache", "tokens", "KV bytes"],
            tablefmt="github",
        ),
        "",
        f"Identical: {demo['identical']}. A single short sequence holds up to one partly filled block more than",
        "DynamicCache; the gains below come from sharing.",
        "",
        "### KV bytes held at the end of generate()",
        "",
        "Rows that share the prompt store it once (reference counts); beams share their common history.",
        "`paged_workspace_bytes` is the reused gather buffer (not pool memory); `ratio_with_workspace` counts it",
        "too. With sdpa it holds one layer's K/V of the largest step (SDPA takes every row's whole context); with",
        'the "hf_paged" attention the rows read the prompt they share once from the pool, and it holds their tails.',
        "DynamicCache runs sdpa in both rows.",
        "",
        tabulate(results["kv_bytes_held"], headers="keys", tablefmt="github", floatfmt=".3f"),
        "",
        "### Sliding-window model: K/V bytes held at the end of generate()",
        "",
        "The default model's sizes with a sliding window on every layer (Mistral-style, one layer group), and as a",
        "Gemma3-style model of 5 sliding layers then 1 full layer (one layer group per layer). DynamicCache keeps",
        "the last window - 1 tokens per sliding layer; PagedCache gives back, per layer group, the blocks that fell",
        "out of the window of every layer in the group.",
        "",
        tabulate(results["sliding_window_bytes"], headers="keys", tablefmt="github", floatfmt=".3f"),
        "",
        "### Decode speed, generate() with each cache on the same pre-filled context",
        "",
        "Contexts are pre-filled with random K/V (identical for both caches) so only decode steps are timed;",
        "tok/s is the best of interleaved rounds (every round runs each variant once, in turn), ratio = best",
        "paged / best dynamic, spread = the lowest and highest per-round ratio. `paged+sdpa` returns each row's",
        "K/V from `PagedCache.update`: a strided view of the pool where the row's blocks are consecutive (one",
        "row in a private pool, batch 1 here), else a gather into the shared workspace. `paged+hf_paged` runs",
        "the registered attention: on CUDA the Triton kernel reads the pool, on CPU it is the same K/V and SDPA.",
        "",
        tabulate(results["decode_speed"], headers="keys", tablefmt="github", floatfmt=".3f"),
        "",
    ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
