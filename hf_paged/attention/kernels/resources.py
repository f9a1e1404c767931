"""Every Triton kernel variant the launchers pick, compiled for sm_80 / sm_90 without a GPU, with its resources.

How: the launchers (`paged_decode_attention_triton`, `paged_prefill_attention_triton`, `store_kv_triton`) run on small
CPU tensors while `JITFunction.run` only records each launch (kernel, arguments, constexprs, num_warps / num_stages) and
`launch_config.device_capability` answers the target's capability, so the recorded launches are exactly what the
launchers choose on that GPU. Each distinct launch (Triton's own specialization key: argument types, divisibility of
ints and pointers, constexprs, options) is compiled with `triton.compile(..., target=GPUTarget("cuda", cap, 32))` and
`cuobjdump --dump-resource-usage` on its cubin gives registers, stack (register spills) and shared memory.

Used by tests/test_kernel_compile.py (no variant may spill) and `python -m bench.kernel_resources` (the table in
docs/kernels.md). Needs the kernels defined as real JIT functions: run it in a process without TRITON_INTERPRET
(`measure_in_subprocess` does), not in the test process, where conftest.py sets it.

    python -m hf_paged.attention.kernels.resources --json variants.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from . import launch_config

# The shapes and options the launchers are driven over (docs/kernels.md, "How the variants are found").
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 160, 192, 256)  # multiples of 16 up to 256; each tile width, and some inside
GROUPS = (1, 2, 4, 7, 8, 16, 32)
BLOCK_SIZES = (8, 16, 32, 64, 128)
SPLITS = (1, 8)
# A block size that is not a power of two takes the kernels' general addressing (`SLOT_ROWS` off: block id times
# block stride plus offset, by division), as blocks whose slots are not consecutive rows do; those variants are
# compiled at these head sizes (the tiles the launch table tunes), each dtype and every option.
GENERAL_BLOCK_SIZE = 12
GENERAL_HEAD_DIMS = (64, 128, 256)
DECODE_OPTIONS = ("plain", "kv_start", "window", "softcap", "all")
PREFILL_OPTIONS = ("plain", "kv_start", "window", "softcap", "sinks", "all")
KERNEL_NAMES = ("_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel", "_store_kv_kernel")

# Per-SM limits (CUDA occupancy calculator): registers, shared memory per SM and per block (opt-in), warps, blocks.
ARCH_LIMITS = {
    80: dict(registers=65536, shared_per_sm=164 * 1024, shared_per_block=163 * 1024, warps=64, blocks=32),
    90: dict(registers=65536, shared_per_sm=228 * 1024, shared_per_block=227 * 1024, warps=64, blocks=32),
}
RESERVED_SHARED_PER_BLOCK = 1024  # the CUDA runtime's own shared memory in every block (sm_80 and later)


@dataclass
class Variant:
    """One distinct compiled form of a kernel, and what the launchers asked for when they picked it."""

    kernel: str
    capability: int
    dtypes: str  # the distinct float pointer types in argument order, e.g. "*bf16 *fp32" (cache, partials)
    constexprs: dict  # name -> value, as launched
    num_warps: int
    num_stages: int
    example: str  # the first launcher call that picked this variant
    num_launches: int = 1  # how many of the driven launcher calls picked it
    # filled by `compile_variant`
    registers: int | None = None
    stack_bytes: int | None = None  # stack frame per thread: register spills (the kernels make no calls)
    local_bytes: int | None = None
    shared_bytes: int | None = None
    compile_s: float | None = None
    error: str | None = None


def nvidia_tools() -> dict[str, str] | None:
    """Paths of ptxas (sm_80), ptxas-blackwell (sm_90; Triton's newer ptxas) and cuobjdump; None if any is missing."""
    from triton import knobs

    try:
        return {
            "ptxas": knobs.nvidia.ptxas.path,
            "ptxas-blackwell": knobs.nvidia.ptxas_blackwell.path,
            "cuobjdump": knobs.nvidia.cuobjdump.path,
        }
    except RuntimeError:
        return None


@dataclass
class _Launch:
    fn: object  # triton JITFunction
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def _recorded_launches(capability: int):
    """Within: Triton launches are recorded in the yielded list instead of run, and the launchers see a GPU of
    `capability`."""
    from triton.runtime.jit import JITFunction

    from .direct import through_jit_run

    launches: list[_Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(_Launch(self, args, kwargs))

    saved_run, saved_capability = JITFunction.run, launch_config.device_capability
    JITFunction.run = record
    launch_config.device_capability = lambda device: capability
    try:
        with through_jit_run():  # every launch through JITFunction.run, which records it
            yield launches
    finally:
        JITFunction.run, launch_config.device_capability = saved_run, saved_capability


class _Specializer:
    """What `JITFunction.run` computes before it compiles, for a given target instead of the current device."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.capability = capability
        self.backend = make_backend(GPUTarget("cuda", capability, 32))
        self.binders = {}  # kernel -> Triton's argument binder for this backend (building one is slow)

    def __call__(self, launch: _Launch):
        """(Triton's cache key, signature, constexprs, attrs, options) of one recorded launch."""
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        fn = launch.fn
        kwargs = dict(launch.kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9 passes it too; 3.6 has no such knob
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = self.binders[fn](*launch.args, **kwargs)
        key = (fn.__name__, self.capability, str(specialization), str(sorted(options.items())))
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization, options)
        return key, signature, constexprs, attrs, options


def _small_decode_call(dtype, head_dim, group, block_size, num_splits, option) -> None:
    """One `paged_decode_attention_triton` call on CPU tensors laid out as the pool and the models lay them out."""
    from .triton_decode import paged_decode_attention_triton

    batch, num_kv_heads, num_blocks = 2, 2, 6
    # the query as attention hands it over: [B, heads, 1, head_dim] from a transposed projection, position 0
    query = torch.zeros(batch, 1, num_kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)[:, :, 0]
    # the head-major pool [kv_heads, num_blocks, block_size, head_dim], viewed as NHD (BlockPool.nhd_view)
    pool = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3)
    # tables, lengths and first keys in the dtype every caller hands the kernels (launch_config.INDEX_DTYPE)
    block_tables = torch.zeros(batch, 3, dtype=launch_config.INDEX_DTYPE)
    seq_lens = torch.full((batch,), 2 * block_size, dtype=launch_config.INDEX_DTYPE)
    kwargs = {}
    if option in ("kv_start", "all"):
        kwargs["kv_start"] = torch.zeros(batch, dtype=launch_config.INDEX_DTYPE)
    if option in ("window", "all"):
        kwargs["sliding_window"] = 4096
    if option in ("softcap", "all"):
        kwargs["softcap"] = 30.0
    paged_decode_attention_triton(
        query, pool, pool, block_tables, seq_lens, scale=head_dim**-0.5, num_splits=num_splits, **kwargs
    )


def _small_prefill_call(dtype, head_dim, group, block_size, option) -> None:
    """One `paged_prefill_attention_triton` call as the packed step makes it: a query from a transposed projection,
    two sequences' chunks, the NHD view of the head-major pool."""
    from .triton_prefill import paged_prefill_attention_triton

    num_kv_heads, num_blocks, num_tokens = 2, 6, 5
    query = torch.zeros(1, num_kv_heads * group, num_tokens, head_dim, dtype=dtype).transpose(1, 2)[0]
    pool = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3)
    block_tables = torch.zeros(2, 3, dtype=launch_config.INDEX_DTYPE)
    cu_seqlens_q = torch.tensor([0, 2, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([block_size + 2, 3], dtype=launch_config.INDEX_DTYPE)
    kwargs = {}
    if option in ("kv_start", "all"):
        kwargs["kv_start"] = torch.zeros(2, dtype=launch_config.INDEX_DTYPE)
    if option in ("window", "all"):
        kwargs["sliding_window"] = 4096
    if option in ("softcap", "all"):
        kwargs["softcap"] = 30.0
    if option in ("sinks", "all"):
        kwargs["sinks"] = torch.zeros(num_kv_heads * group)
    paged_prefill_attention_triton(
        query, pool, pool, block_tables, cu_seqlens_q, seq_lens, scale=head_dim**-0.5, **kwargs
    )


def _small_store_call(key_dtype, cache_dtype, head_dim, block_size, num_tokens) -> None:
    """One `store_kv_triton` call as `store_kv_rows` makes it: rows from [W, kv_heads, q_len, head_dim] states into
    the NHD view of the head-major pool."""
    from .triton_store import store_kv_triton

    num_kv_heads, num_blocks = 2, 4
    states = torch.zeros(1, num_kv_heads, num_tokens, head_dim, dtype=key_dtype)
    rows = states.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
    pool = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=cache_dtype).permute(1, 2, 0, 3)
    store_kv_triton(rows, rows, pool, pool, torch.arange(num_tokens))


def _driven_calls():
    """(description, thunk) for every launcher call the check drives: each dtype and head_dim with every split and
    option choice (what the launchers decide from), and with every GQA group and block size (runtime arguments,
    which must not add variants)."""
    decode_calls = (
        [
            (dtype, head_dim, 4, 16, num_splits, option)
            for dtype, head_dim, num_splits, option in itertools.product(DTYPES, HEAD_DIMS, SPLITS, DECODE_OPTIONS)
        ]
        + [
            (dtype, head_dim, group, block_size, num_splits, option)
            for dtype, head_dim, group, block_size in itertools.product(DTYPES, HEAD_DIMS, GROUPS, BLOCK_SIZES)
            for num_splits, option in ((1, "plain"), (8, "all"))
        ]
        + [
            (dtype, head_dim, 4, GENERAL_BLOCK_SIZE, num_splits, option)
            for dtype, head_dim in itertools.product(DTYPES, GENERAL_HEAD_DIMS)
            for num_splits, option in ((1, "plain"), (8, "all"))
        ]
    )
    for dtype, head_dim, group, block_size, num_splits, option in decode_calls:
        name = str(dtype).removeprefix("torch.")
        description = (
            f"decode {name} head_dim={head_dim} group={group} block_size={block_size} splits={num_splits} {option}"
        )
        yield description, lambda a=(dtype, head_dim, group, block_size, num_splits, option): _small_decode_call(*a)
    # the prefill kernel: a variant per (dtype, head_dim tile, q heads per program, softcap, sinks)
    prefill_calls = (
        [
            (dtype, head_dim, group, 16, "plain")
            for dtype, head_dim, group in itertools.product(DTYPES, HEAD_DIMS, GROUPS)
        ]
        + [
            (dtype, head_dim, 4, block_size, option)
            for dtype, head_dim, block_size, option in itertools.product(DTYPES, HEAD_DIMS, (8, 128), PREFILL_OPTIONS)
        ]
        + [
            (dtype, head_dim, 4, GENERAL_BLOCK_SIZE, option)
            for dtype, head_dim, option in itertools.product(DTYPES, GENERAL_HEAD_DIMS, ("plain", "all"))
        ]
    )
    for dtype, head_dim, group, block_size, option in prefill_calls:
        name = str(dtype).removeprefix("torch.")
        description = f"prefill {name} head_dim={head_dim} group={group} block_size={block_size} {option}"
        yield description, lambda a=(dtype, head_dim, group, block_size, option): _small_prefill_call(*a)
    # a model's K/V rows arrive in its dtype; fp32 rows into a 16-bit pool are a supported conversion too
    dtype_pairs = [(dtype, dtype) for dtype in DTYPES] + [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
    ]
    for (key_dtype, cache_dtype), head_dim, block_size, num_tokens in itertools.product(
        dtype_pairs, HEAD_DIMS, BLOCK_SIZES, (1, 5)
    ):
        names = f"{str(key_dtype).removeprefix('torch.')}->{str(cache_dtype).removeprefix('torch.')}"
        description = f"store {names} head_dim={head_dim} block_size={block_size} tokens={num_tokens}"
        yield description, lambda a=(key_dtype, cache_dtype, head_dim, block_size, num_tokens): _small_store_call(*a)


def _dtypes(signature: dict) -> str:
    pointer_types = [t for name, t in signature.items() if name.endswith("_ptr") and "i32" not in t and "i64" not in t]
    distinct = list(dict.fromkeys(pointer_types))
    return " ".join(distinct)


def collect_variants(capabilities=launch_config.CHECKED_CAPABILITIES) -> tuple[list[Variant], list[tuple], int]:
    """Drive the launchers for each capability; return (distinct variants, the `compile_variant` input of each, number
    of launcher calls driven)."""
    variants: dict[tuple, Variant] = {}
    compile_inputs: dict[tuple, tuple] = {}
    num_calls = 0
    for capability in capabilities:
        specialize = _Specializer(capability)
        for description, call in _driven_calls():
            with _recorded_launches(capability) as launches:
                call()
            num_calls += 1
            for launch in launches:
                key, signature, constexprs, attrs, options = specialize(launch)
                if key in variants:
                    variants[key].num_launches += 1
                    continue
                named = {launch.fn.arg_names[path[0]]: value for path, value in constexprs.items()}
                variants[key] = Variant(
                    kernel=launch.fn.__name__,
                    capability=capability,
                    dtypes=_dtypes(signature),
                    constexprs={k: v for k, v in named.items() if k.isupper()},
                    num_warps=options.num_warps,
                    num_stages=options.num_stages,
                    example=description,
                )
                compile_inputs[key] = (
                    launch.fn.__module__,
                    launch.fn.__name__,
                    signature,
                    constexprs,
                    attrs,
                    options.__dict__,
                    capability,
                )
    keys = list(variants)
    return [variants[k] for k in keys], [compile_inputs[k] for k in keys], num_calls


_RESOURCE_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_variant(inputs: tuple) -> dict:
    """Compile one recorded launch for its target; registers, stack, local and shared bytes from its cubin."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, kernel_name, signature, constexprs, attrs, options, capability = inputs
    fn = getattr(importlib.import_module(module_name), kernel_name)

    start = time.perf_counter()
    try:
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32), options=options
        )
    except Exception as error:  # a variant that does not compile is a result to report, not a crash
        return {"error": f"{type(error).__name__}: {str(error)[-2000:]}"}
    compile_s = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [nvidia_tools()["cuobjdump"], "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    match = _RESOURCE_LINE.search(dump)
    if match is None:
        return {"error": f"no resource line in cuobjdump's output:\n{dump}"}
    registers, stack, shared, local = map(int, match.groups())
    # Triton's shared memory is dynamic (its size is in the metadata); cuobjdump's SHARED is the static part, which
    # for these kernels is at most the runtime's reserved 1 KiB (sm_90), counted separately by blocks_per_sm
    shared = max(shared, kernel.metadata.shared)
    return dict(
        registers=registers, stack_bytes=stack, shared_bytes=shared, local_bytes=local, compile_s=round(compile_s, 2)
    )


def measure(capabilities=launch_config.CHECKED_CAPABILITIES, jobs: int | None = None) -> dict:
    """Collect and compile every variant: {"variants": [Variant as dict], "num_calls": int, "seconds": float}."""
    from triton.runtime.jit import JITFunction

    from . import triton_decode

    if not isinstance(triton_decode._paged_decode_kernel, JITFunction):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET is set): run measure_in_subprocess()")
    if nvidia_tools() is None:
        raise RuntimeError("ptxas or cuobjdump not found in the triton wheel (triton/backends/nvidia/bin)")
    start = time.perf_counter()
    variants, inputs, num_calls = collect_variants(capabilities)
    jobs = jobs or min(len(inputs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for variant, result in zip(variants, pool.map(compile_variant, inputs)):
            for name, value in result.items():
                setattr(variant, name, value)
    return {
        "variants": [asdict(v) for v in variants],
        "num_calls": num_calls,
        "seconds": round(time.perf_counter() - start, 1),
    }


def measure_in_subprocess(jobs: int | None = None, timeout: float = 900) -> dict:
    """`measure()` in a fresh Python without TRITON_INTERPRET (the kernels must be real JIT functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launchers' default, stated to keep Triton quiet
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "variants.json")
        command = [sys.executable, "-m", __name__, "--json", path]
        if jobs:
            command += ["--jobs", str(jobs)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)


def blocks_per_sm(registers: int, shared_bytes: int, num_warps: int, capability: int) -> dict:
    """Resident blocks per SM (the occupancy calculator's rule) and what limits them: registers (allocated per warp
    in units of 256), shared memory (plus the runtime's 1 KiB per block), warps, or the block limit."""
    limits = ARCH_LIMITS[capability]
    registers_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by = {  # on a tie, the first named binds: the fixed limits before the ones a kernel could lower
        "blocks": limits["blocks"],
        "warps": limits["warps"] // num_warps,
        "registers": limits["registers"] // (registers_per_warp * num_warps),
        "shared": limits["shared_per_sm"] // (shared_bytes + RESERVED_SHARED_PER_BLOCK),
    }
    limit = min(by, key=by.get)
    return {"blocks": by[limit], "limit": limit, "warps": by[limit] * num_warps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Compile every launched kernel variant; resources as JSON.")
    parser.add_argument("--json", required=True, help="output path")
    parser.add_argument("--jobs", type=int, help="parallel compiles (default: CPU count)")
    args = parser.parse_args(argv)
    report = measure(jobs=args.jobs)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
