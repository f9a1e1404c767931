"""`python bench/generate_speed.py`: plain `generate()` with each cache, milliseconds per new token, side by side.

The model is Llama-3.2-1B's shape with random weights (hidden 2048, 16 layers, 32 q / 8 kv heads, head_dim 64,
intermediate 8192, vocab 128256), built from its config (no download); a prompt of `--prompt-len` random tokens and
`--new-tokens` greedy tokens, at each `--batch`. Variants, run in turn (DynamicCache first and last, so drift shows):

    dynamic                DynamicCache, sdpa (transformers' default)
    paged                  PagedCache, sdpa
    paged+hf_paged         PagedCache after hf_paged.enable(model) (the Triton decode kernel on CUDA)
    paged+torch-store      PagedCache, sdpa, storing with `index_copy_` where CUDA launches the Triton store
                           (HF_PAGED_ATTENTION_BACKEND=torch while it runs): what the store's launch costs eagerly
    paged+contiguous-kv    PagedCache, sdpa, handing SDPA contiguous copies of the K/V as DynamicCache does (two
                           copies a layer more): what SDPA on the pool's strided view costs
    static-compiled        StaticCache(max_cache_len): generate() compiles the decode forward (CUDA graphs on CUDA)
    paged-compiled         PagedCache(max_cache_len), sdpa, compiled the same way
    paged+hf_paged-compiled PagedCache(max_cache_len) with the "hf_paged" attention, compiled

Time is wall time of the whole generate() over the new tokens (best of `--repeats`, after one warm-up generate that also
compiles; the eager variants in rounds that run each once, in turn, so that a drift of the machine's speed weighs on
all alike), then of a generate() of one new token (the prompt's forward: "prompt ms"), each best of `--repeats`; "decode
ms per token" is the difference over the other new tokens. Each PagedCache variant has a pool of its own with room for
all its runs, so that, as in a private pool, a row's blocks are consecutive and batch 1's attention reads a view of the
pool (a pool whose freed blocks are handed out again wrapping from its last id to its first has its rows gather: `python
-m bench.layer_costs` times both). The timed runs reuse the warm-up's cache, emptied in between (`PagedCache.release()`,
`StaticCache.reset()`), as a server keeps its caches: the compiled step's CUDA graphs read the cache's static buffers in
place, so a new cache would record them again; DynamicCache is made anew, as generate() makes it. Then `--check-dtype`
(float32 by default) runs every variant once more for tokens, each against DynamicCache's. On CPU, `--tiny` runs the
same on a 2-layer model in seconds (a dry run of the script); compiled variants then need `--compile-all-devices`
(transformers compiles by itself on CUDA only).

Then `--trace-steps` decode steps at batch 1 in the speed dtype, teacher-forced: DynamicCache's greedy tokens are fed
to each eager PagedCache variant, and every step's logits are compared with DynamicCache's (bit for bit, largest
difference, argmax), with what SDPA received at layer 0 (the K strides: a view of the pool or a contiguous tensor) and
the backend it picks for those inputs (`torch._fused_sdp_choice`). "paged, contiguous K/V" hands SDPA a contiguous
copy of the same K/V, as DynamicCache does, so a difference that only the view causes shows as the two disagreeing.

With `--host-profile N`, each eager variant's generate() of N new tokens at batch `--profile-batch` (1 by default)
runs once more under cProfile:
the host time per new token by where it is spent (hf_paged, transformers, torch, triton, the rest; C functions such
as an ATen call or a kernel launch counted where they are defined, `~`: builtins) and the functions with the most own
time. The builtins' time includes the host's waits for the GPU (generate() reads each step's tokens; the run ends
with a synchronize), and the prompt's forward is one of the N + 1 forwards counted. cProfile slows Python down, so
the numbers compare variants with each other, not with the timed runs. Then the same runs under torch.profiler:
per new token the ATen operators each variant makes and their own host time, and on CUDA every call of the CUDA
runtime (launches, copies, waits such as `cudaStreamSynchronize`, allocations), counted and timed, and the GPU's
kernel time per new token with the kernels that take most of it (what a batch spends on the device, against the
host's time).

    python bench/generate_speed.py --json bench/results/gpu/generate.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import cProfile
import json
import os
import pstats
import re
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import DynamicCache, StaticCache
from transformers.generation import CompileConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hf_paged  # noqa: E402
from bench.host import device_name, versions  # noqa: E402
from bench.models import LLAMA_1B_SHAPE, TINY_SHAPE, llama_shaped  # noqa: E402
from hf_paged import BlockPool, PagedCache  # noqa: E402
from hf_paged.attention.kernels import BACKEND_ENV_VAR  # noqa: E402

VARIANTS = (
    "dynamic",
    "paged",
    "paged+hf_paged",
    "paged+torch-store",
    "paged+contiguous-kv",
    "static-compiled",
    "paged-compiled",
    "paged+hf_paged-compiled",
)


def build_model(shape: dict, dtype: torch.dtype, device: str):
    """The sdpa model and a copy on the "hf_paged" attention."""
    model = llama_shaped(shape, dtype, device)
    return model, hf_paged.enable(copy.deepcopy(model))


def make_cache(variant: str, model, pool: BlockPool, max_cache_len: int):
    if variant == "dynamic":
        return DynamicCache(config=model.config)
    if variant == "static-compiled":
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    compiled = variant.endswith("-compiled")
    if variant == "paged+contiguous-kv":
        return _contiguous_kv(PagedCache(config=model.config, pool=pool))
    return PagedCache(config=model.config, pool=pool, max_cache_len=max_cache_len if compiled else None)


def run(variant, models, pool, input_ids, new_tokens, compile_config, fresh: bool = False, cache=None):
    """One generate() -> (tokens, seconds, the cache, emptied for another run); `fresh`: forget what dynamo compiled
    before (the graphs of the other variants and batches, which all compile the same forward code and would exhaust
    its recompile limit); `cache`: one an earlier run returned (a new one without it)."""
    model = models[1] if "hf_paged" in variant else models[0]
    if fresh and variant.endswith("-compiled"):
        torch._dynamo.reset()
    if cache is None:
        cache = make_cache(variant, model, pool, input_ids.shape[1] + new_tokens)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if variant.endswith("-compiled") and compile_config is not None:
        options["compile_config"] = compile_config
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode(), _backend(variant):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, **options)
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if isinstance(cache, PagedCache):
        cache.release()
    elif isinstance(cache, StaticCache):
        with torch.inference_mode():  # its tensors were made there
            cache.reset()
    return out, seconds, cache


def _warm_cache(variant, models, pool, input_ids, new_tokens, compile_config):
    """A warm-up generate() of `variant` (it compiles a compiled one) -> the cache its timed runs reuse, emptied (None
    for DynamicCache, which generate() makes anew at every run)."""
    _, _, cache = run(variant, models, pool, input_ids, new_tokens, compile_config, fresh=True)
    return None if variant == "dynamic" else cache


def _timed_rounds(warm: dict, models, input_ids, args, compile_config) -> list[tuple[str, tuple[float, float]]]:
    """[(variant, (best seconds of a generate() of `args.new_tokens`, best seconds of one of a single new token: the
    prompt's forward))] for each variant of `warm` (variant -> (pool, warm cache)), over `args.repeats` rounds that
    each run every variant once, in turn."""
    whole, prompt = ({variant: [] for variant in warm} for _ in range(2))
    for new_tokens, times in ((args.new_tokens, whole), (1, prompt)):
        for _ in range(args.repeats):
            for variant, (pool, cache) in warm.items():
                times[variant].append(run(variant, models, pool, input_ids, new_tokens, compile_config, cache=cache)[1])
    return [(variant, (min(whole[variant]), min(prompt[variant]))) for variant in warm]


@contextlib.contextmanager
def _backend(variant: str):
    """Within: the kernel backend `variant` asks for (HF_PAGED_ATTENTION_BACKEND=torch for "paged+torch-store",
    the environment as it is otherwise)."""
    if variant != "paged+torch-store":
        yield
        return
    saved = os.environ.get(BACKEND_ENV_VAR)
    os.environ[BACKEND_ENV_VAR] = "torch"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[BACKEND_ENV_VAR]
        else:
            os.environ[BACKEND_ENV_VAR] = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float16", "float32", "none"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--check-tokens", type=int, default=64, help="new tokens of the identity check")
    parser.add_argument(
        "--trace-steps", type=int, default=32, help="teacher-forced steps of the logits trace (0: none)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a dry run on CPU")
    parser.add_argument("--compile-all-devices", action="store_true", help="compile on CPU too (aot_eager)")
    parser.add_argument("--host-profile", type=int, default=0, help="new tokens of each eager variant's cProfile")
    parser.add_argument("--profile-batch", type=int, default=1, help="the batch of the --host-profile runs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    compile_config = None
    if args.compile_all_devices:
        compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        compile_config._compile_all_devices = True
    elif args.device != "cuda":
        args.variants = [v for v in args.variants if not v.endswith("-compiled")]
    shape = TINY_SHAPE if args.tiny else LLAMA_1B_SHAPE
    results = {"args": vars(args), "device": device_name(args.device), "versions": versions(), "speed": []}
    speed_rows = []

    def save() -> None:
        """Write what is measured so far (a run stopped by a timeout leaves its finished variants)."""
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1))

    models = build_model(shape, getattr(torch, args.dtype), args.device)
    for batch in args.batch:
        generator = torch.Generator().manual_seed(batch)
        input_ids = torch.randint(1, shape["vocab_size"], (batch, args.prompt_len), generator=generator)
        input_ids = input_ids.to(args.device)
        # A warm-up of each variant that compiles, then timed runs on its cache (but DynamicCache's, made anew each
        # time, as generate() does): a compiled step's CUDA graphs read the cache's buffers in place and replay.
        # The eager variants run in rounds, each variant once a round, so that a drift of the machine's speed
        # during the run weighs on all of them alike; then the compiled ones, one after the other (the warm-up of
        # one forgets what dynamo compiled for the others).
        eager = [variant for variant in args.variants if not variant.endswith("-compiled")]
        groups = [eager, *([variant] for variant in args.variants if variant not in eager)]
        for variants in groups:
            warm = {}
            for variant in variants:
                # room for the warm-up and the timed runs, whole and of the prompt alone
                pool = BlockPool.for_model(
                    models[0], num_blocks=_num_blocks(batch, args, 2 * args.repeats + 1), block_size=16
                )
                warm[variant] = pool, _warm_cache(variant, models, pool, input_ids, args.new_tokens, compile_config)
            for variant, (seconds, prompt_seconds) in _timed_rounds(warm, models, input_ids, args, compile_config):
                ms_per_token = seconds / args.new_tokens * 1e3
                decode_ms = max(seconds - prompt_seconds, 0.0) / max(args.new_tokens - 1, 1) * 1e3
                results["speed"].append(
                    dict(
                        batch=batch,
                        variant=variant,
                        ms_per_token=ms_per_token,
                        prompt_ms=prompt_seconds * 1e3,
                        decode_ms_per_token=decode_ms,
                    )
                )
                save()
                prompt_ms = f"{prompt_seconds * 1e3:.1f}"
                speed_rows.append([batch, variant, f"{ms_per_token:.2f}", prompt_ms, f"{decode_ms:.2f}"])
                print(
                    f"batch {batch:3d} {variant:26s} {ms_per_token:8.2f} ms/token, prompt {prompt_ms} ms, "
                    f"decode {decode_ms:.2f} ms/token",
                    flush=True,
                )
    headers = ["batch", "variant", "ms per new token", "prompt ms", "decode ms per token"]
    print(tabulate(speed_rows, headers, tablefmt="github"))

    if args.host_profile:
        results["host_profile"], results["op_profile"] = eager_profiles(models, shape, args)
        save()

    if args.trace_steps:
        results["trace"] = trace_logits(models, shape, args)
        save()
    if args.check_dtype != "none":
        results["identity"] = check_tokens(args, shape, compile_config)
    save()
    return 0


HOST_GROUPS = ("hf_paged", "transformers", "torch", "triton")
TOP_FUNCTIONS = 15


def _host_group(filename: str) -> str:
    """Where a profiled function is defined: a package of HOST_GROUPS, "builtin" (`~`: C functions such as ATen
    calls and kernel launches), or "other"."""
    if filename == "~":
        return "builtin"
    # The innermost package of the path: triton's files under /opt/torch/.venv/... are triton's, not torch's.
    return next((part for part in reversed(Path(filename).parts) if part in HOST_GROUPS), "other")


def eager_profiles(models, shape: dict, args) -> tuple[dict, dict]:
    """Each eager variant's generate() of `--host-profile` new tokens at batch `--profile-batch`, after a warm-up run,
    once under cProfile (`host_profile`: the Python) and once under torch.profiler (`op_profile`: what its ATen calls,
    launches and kernels cost and any wait a step makes). Returns both, by variant."""
    generator = torch.Generator().manual_seed(1)
    batch = args.profile_batch
    input_ids = torch.randint(1, shape["vocab_size"], (batch, args.prompt_len), generator=generator).to(args.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if input_ids.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    host, ops = {}, {}
    for variant in [v for v in args.variants if not v.endswith("-compiled")]:
        pool = BlockPool.for_model(models[0], num_blocks=_num_blocks(batch, args, 3), block_size=16)
        _, _, cache = run(variant, models, pool, input_ids, args.host_profile, None)  # warm-up
        cache = None if variant == "dynamic" else cache
        profiler = cProfile.Profile()
        profiler.enable()
        _, seconds, _ = run(variant, models, pool, input_ids, args.host_profile, None, cache=cache)
        profiler.disable()
        host[variant] = _host_profile(profiler, seconds, args.host_profile)
        print(f"host profile {variant}: {host[variant]['ms_per_token_by_group']}", flush=True)
        with torch.profiler.profile(activities=activities) as torch_profiler:
            run(variant, models, pool, input_ids, args.host_profile, None, cache=cache)
        ops[variant] = _op_profile(torch_profiler, args.host_profile)
        print(
            f"operators {variant}: {ops[variant]['aten_calls_per_token']:.0f} ATen calls, "
            f"{ops[variant]['aten_us_per_token']:.0f} us a token",
            flush=True,
        )
    return host, ops


def _host_profile(profiler: cProfile.Profile, seconds: float, new_tokens: int) -> dict:
    """A cProfile run of `new_tokens` new tokens in `seconds`: host ms per new token by `_host_group`, and the
    functions with the most own time."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, own s, cumulative s, callers)
    by_group = collections.Counter()
    for (filename, _, _), (_, _, own, _, _) in stats.items():
        by_group[_host_group(filename)] += own
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:TOP_FUNCTIONS]
    per_token = 1e3 / new_tokens
    return dict(
        ms_per_token=seconds * per_token,
        ms_per_token_by_group={group: own * per_token for group, own in by_group.most_common()},
        top=[
            dict(
                function=f"{Path(filename).name}:{line} {name}" if filename != "~" else name,
                calls_per_token=calls / new_tokens,
                own_us_per_token=own * per_token * 1e3,
            )
            for (filename, line, name), (_, calls, own, _, _) in top
        ],
    )


TOP_OPERATORS = 10
TOP_KERNELS = 12
KERNEL_NAME_CHARS = 100  # a template kernel's name runs to hundreds of characters
_RUNTIME_CALL = re.compile(r"cuda[A-Z]|cu[A-Z]|cudnn")  # cudaLaunchKernel, cuLaunchKernelEx, cudnnFind...


def _event_kind(name: str) -> str | None:
    """ "aten" for an ATen operator, "runtime" for a call of the CUDA runtime, driver or cuDNN (a launch, a copy, a
    wait, an allocation), None for anything else the profiler records (annotations, kernels on the device)."""
    if name.startswith("aten::"):
        return "aten"
    if _RUNTIME_CALL.match(name):
        return "runtime"
    return None


def _op_profile(profiler: torch.profiler.profile, new_tokens: int) -> dict:
    """A torch.profiler run of `new_tokens` new tokens (the host's operators and, on CUDA, the runtime's calls and
    the kernels): per new token, the ATen operators made and their own host time, every CUDA runtime call (launches,
    copies, waits such as `cudaStreamSynchronize`, host or device allocations) with its count and own time, the
    operators with the most own time, the GPU's kernel time and the kernels that take most of it."""
    per_token = 1 / new_tokens
    kinds = {"aten": [], "runtime": []}
    kernels = []
    for event in profiler.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or copy) on the device
            if event.self_device_time_total > 0:
                kernels.append(event)
            continue
        kind = _event_kind(event.key)
        if kind is not None and event.self_cpu_time_total > 0:
            kinds[kind].append(event)
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return dict(
        kernel_us_per_token=sum(e.self_device_time_total for e in kernels) * per_token,
        kernels=[
            dict(
                kernel=e.key[:KERNEL_NAME_CHARS],
                calls_per_token=e.count * per_token,
                us_per_token=e.self_device_time_total * per_token,
            )
            for e in kernels[:TOP_KERNELS]
        ],
        aten_calls_per_token=sum(e.count for e in kinds["aten"]) * per_token,
        aten_us_per_token=sum(e.self_cpu_time_total for e in kinds["aten"]) * per_token,
        runtime={
            e.key: dict(calls_per_token=e.count * per_token, us_per_token=e.self_cpu_time_total * per_token)
            for e in sorted(kinds["runtime"], key=lambda e: -e.self_cpu_time_total)
        },
        top=[
            dict(
                operator=e.key,
                calls_per_token=e.count * per_token,
                us_per_token=e.self_cpu_time_total * per_token,
            )
            for e in sorted(kinds["aten"], key=lambda e: -e.self_cpu_time_total)[:TOP_OPERATORS]
        ],
    )


def check_tokens(args, shape: dict, compile_config) -> list[dict]:
    """Every variant's greedy tokens against DynamicCache's, in `args.check_dtype`, at each batch."""
    models = build_model(shape, getattr(torch, args.check_dtype), args.device)
    rows = []
    for batch in args.batch:
        generator = torch.Generator().manual_seed(1000 + batch)
        input_ids = torch.randint(1, shape["vocab_size"], (batch, args.prompt_len), generator=generator)
        input_ids = input_ids.to(args.device)
        pool = BlockPool.for_model(models[0], num_blocks=_num_blocks(batch, args), block_size=16)
        expected = run("dynamic", models, pool, input_ids, args.check_tokens, compile_config)[0]
        for variant in args.variants:
            got = run(variant, models, pool, input_ids, args.check_tokens, compile_config, fresh=True)[0]
            same = (got == expected).all(dim=-1)
            first = (got != expected).int().argmax(dim=-1)
            differing = [int(f) - args.prompt_len for f, s in zip(first.tolist(), same.tolist()) if not s]
            rows.append(
                dict(batch=batch, variant=variant, identical_rows=int(same.sum()), rows=batch, first_diff=differing)
            )
            print(f"tokens {args.check_dtype} batch {batch:3d} {variant:26s} {int(same.sum())}/{batch} rows identical")
    return rows


TRACE_VARIANTS = ("paged", "paged, contiguous K/V", "paged+hf_paged")


class _SdpaInputs:
    """Records what `scaled_dot_product_attention` receives at the first call of each forward (layer 0): K's layout
    (contiguous, or the strides of a view) and the backend SDPA picks for those inputs."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []  # (K's layout, SDPA's backend)
        self.armed = False
        self._sdpa = torch.nn.functional.scaled_dot_product_attention

    def __enter__(self):
        sdpa = self._sdpa

        def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
            if self.armed:
                self.armed = False
                choice = torch._fused_sdp_choice(
                    query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs
                )
                layout = "contiguous" if key.is_contiguous() else f"strided {list(key.stride())}"
                self.calls.append((layout, torch.nn.attention.SDPBackend(choice).name))
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = recording
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._sdpa

    def taken(self) -> list[str]:
        """What SDPA received and picked since the last call, each once ("backend, K layout")."""
        described, self.calls = sorted({f"{backend}, K {layout}" for layout, backend in self.calls}), []
        return described


def _contiguous_kv(cache: PagedCache) -> PagedCache:
    """`cache` handing attention contiguous copies of the K/V it returns (what DynamicCache's `torch.cat` gives)."""
    update = cache.update

    def contiguous_update(*args, **kwargs):
        return tuple(states.contiguous() for states in update(*args, **kwargs))

    cache.update = contiguous_update
    return cache


def _teacher_forced(model, cache, input_ids: torch.Tensor, tokens: list[int] | None, steps: int, sdpa: _SdpaInputs):
    """Prefill `input_ids`, then `steps` decode steps feeding `tokens` (None: the step's own argmax); per step, the
    last position's logits (float32) and what SDPA received at layer 0."""
    logits, fed = [], []
    with torch.inference_mode():
        sdpa.armed = True
        out = model(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache)
        for step in range(steps + 1):
            logits.append(out.logits[0, -1].float())
            if step == steps:
                break
            token = tokens[step] if tokens is not None else int(logits[-1].argmax())
            fed.append(token)
            position = input_ids.shape[1] + step
            sdpa.armed = True
            out = model(
                torch.tensor([[token]], device=input_ids.device),
                attention_mask=torch.ones(1, position + 1, dtype=torch.long, device=input_ids.device),
                position_ids=torch.tensor([[position]], device=input_ids.device),
                cache=cache,
            )
    if isinstance(cache, PagedCache):
        cache.release()
    return logits, fed


def trace_logits(models, shape: dict, args) -> dict:
    """Batch 1, the speed dtype: DynamicCache's greedy tokens fed to each eager PagedCache variant (`TRACE_VARIANTS`);
    per variant, the steps whose logits differ from DynamicCache's, and what SDPA received and picked."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, shape["vocab_size"], (1, args.prompt_len), generator=generator).to(args.device)
    with _SdpaInputs() as sdpa:
        expected, tokens = _teacher_forced(
            models[0], DynamicCache(config=models[0].config), input_ids, None, args.trace_steps, sdpa
        )
        reference = sdpa.taken()
        variants = []
        for variant in TRACE_VARIANTS:
            model = models[1] if "hf_paged" in variant else models[0]
            cache = PagedCache(config=model.config)  # a pool of its own: a row's blocks are consecutive
            if "contiguous" in variant:
                cache = _contiguous_kv(cache)
            got, _ = _teacher_forced(model, cache, input_ids, tokens, args.trace_steps, sdpa)
            differing = [step for step, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
            variants.append(
                dict(
                    variant=variant,
                    differing_steps=differing,
                    max_abs_diff=max(float((a - b).abs().max()) for a, b in zip(got, expected)),
                    argmax_differs=[step for step, (a, b) in enumerate(zip(got, expected)) if a.argmax() != b.argmax()],
                    sdpa=sdpa.taken(),
                )
            )
            first = differing[0] if differing else "none"
            print(
                f"trace {args.dtype} {variant:24s} first step with other logits: {first}, "
                f"max |diff| {variants[-1]['max_abs_diff']:.3g}, SDPA: {variants[-1]['sdpa']}",
                flush=True,
            )
    return dict(dtype=args.dtype, steps=args.trace_steps, dynamic_sdpa=reference, variants=variants)


def _num_blocks(batch: int, args, runs: int = 1) -> int:
    """Blocks for `runs` generate() runs of `batch` rows, each taking fresh blocks: the allocator hands freed blocks
    out again last (FIFO), so no run takes blocks that wrap around from the pool's last id to its first, and a row's
    blocks are consecutive, as a private pool's are (attention then reads a view of the pool, not a gather)."""
    longest = max(args.new_tokens, args.check_tokens, args.host_profile)
    return runs * batch * -(-(args.prompt_len + longest) // 16) + 16


if __name__ == "__main__":
    sys.exit(main())
