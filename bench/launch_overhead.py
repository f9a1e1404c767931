"""`python -m bench.launch_overhead`: the host time of the "hf_paged" attention's Triton launches, without a GPU.

On a GPU, plain `generate()` on a small model is host-bound: each layer's Python and kernel launches are its cost.
Where sdpa makes ATen calls, the "hf_paged" attention's decode step launches Triton kernels (the store, the decode
kernel and, with split-K, the merge), and a Triton launch runs Python of its own (each argument's specialization, the
compiled kernel's lookup) before the CUDA driver's call. This measures that Python on CPU: Triton's driver is
replaced by a stand-in reporting an sm_90 GPU and compiled kernels by no-ops, so `JITFunction.run` and the launchers
run as they would on that GPU up to the driver call.

1. Each launcher alone (Llama-3.2-1B's attention: 32 q / 8 kv heads of 64, bf16, block size 16, a 1024-token
   context; the prefill kernel with 16 new tokens a sequence): host microseconds per call, launching its compiled
   variants directly (hf_paged/attention/kernels/direct.py, as the launchers do) and through `kernel[grid]`
   (`JITFunction.run`), one after the other.
2. A decode step of `generate()` on `bench/host_overhead.py`'s negligible model (16 layers, hidden 64, one thread):
   DynamicCache, PagedCache on sdpa, and PagedCache on "hf_paged" with its launches stood in (its attention output is
   never computed: only time is measured), directly and through `JITFunction.run`. Each variant one step in turn,
   medians of `--steps`, best of `--repeats`.

Left out: the CUDA driver's launch (a few microseconds a kernel) and ATen's own CUDA dispatch, which need a GPU. Runs
in a process without TRITON_INTERPRET (the kernels must be Triton's JIT functions).

    python -m bench.launch_overhead
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAND_IN_CAPABILITY = 90  # the GPU the launchers are told they run on (an H100)
STAND_IN_SMS = 132


class _StandInDriver:
    """Triton's active driver for a machine without a GPU: device 0, stream 0, an sm_90 target."""

    def get_current_device(self) -> int:
        return 0

    stream = 0  # what get_current_stream answers (tests set it)

    def get_current_stream(self, device) -> int:
        return self.stream

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", STAND_IN_CAPABILITY, 32)


class _NoOpKernel:
    """A compiled kernel whose launch does nothing but count itself."""

    function = 0
    packed_metadata = None
    launches = 0  # over every instance

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        _NoOpKernel.launches += 1


def stand_in_launches() -> None:
    """Make every Triton launch of this process run its Python up to the driver and launch nothing: the stand-in
    driver, no-op kernels instead of compiles, and the launchers told of an sm_90 GPU with 132 SMs."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are interpreted, not launched; run without it")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from hf_paged.attention.kernels import dispatch, launch_config, triton_decode

    def no_op_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _NoOpKernel()
        self.device_caches[device][0][key] = kernel
        return kernel

    driver.set_active(_StandInDriver())
    JITFunction._do_compile = no_op_compile
    launch_config.device_capability = lambda device: STAND_IN_CAPABILITY
    triton_decode._num_sms = lambda device: STAND_IN_SMS
    dispatch._triton_interpreting = lambda: True  # "triton" resolves for CPU tensors: they are never read


def best_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Microseconds per call of `fn`, the best of `repeats` loops of `calls` (after a warm-up)."""
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def launcher_rows(calls: int) -> list[list]:
    """Each launcher's host microseconds per call on CPU tensors shaped as on a GPU, launching compiled variants
    directly and through `JITFunction.run`, one after the other."""
    from hf_paged.attention.kernels import direct, launch_config, triton_decode, triton_prefill, triton_store

    num_kv_heads, group, head_dim, num_blocks, block_size = 8, 4, 64, 256, 16
    dtype = torch.bfloat16
    key_cache, value_cache = (
        torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3) for _ in range(2)
    )
    rows = []
    for batch in (1, 16, 32):
        query = torch.zeros(batch, 1, num_kv_heads * group, head_dim, dtype=dtype).transpose(1, 2)[:, :, 0]
        tables = (torch.arange(64 * batch, dtype=launch_config.INDEX_DTYPE) % num_blocks).view(batch, 64)
        lengths = torch.full((batch,), 64 * block_size, dtype=launch_config.INDEX_DTYPE)
        states = torch.zeros(batch, num_kv_heads, 1, head_dim, dtype=dtype)
        slots = torch.arange(batch)
        block_n = launch_config.decode_config(head_dim, dtype, None).block_n
        splits = triton_decode.choose_num_splits(batch, num_kv_heads, 64 * block_size, query.device, block_n)
        step_launch = triton_decode.DecodeLaunch(query, key_cache, value_cache, tables, lengths)
        store_launch = triton_store.StoreLaunch(key_cache, value_cache)
        cases = {
            f"decode, batch {batch} ({splits} split{'s' if splits > 1 else ''}): a layer of a step": functools.partial(
                step_launch, query, key_cache, value_cache, scale=0.125
            ),
            f"decode, batch {batch}: paged_decode_attention_triton": functools.partial(
                triton_decode.paged_decode_attention_triton, query, key_cache, value_cache, tables, lengths, scale=0.125
            ),
            f"store, batch {batch}: a layer's StoreLaunch": functools.partial(store_launch, states, states, slots),
            f"prefill, batch {batch} (16 new tokens each)": functools.partial(
                triton_prefill.paged_prefill_attention_triton,
                torch.zeros(1, num_kv_heads * group, 16 * batch, head_dim, dtype=dtype).transpose(1, 2)[0],
                key_cache,
                value_cache,
                tables,
                torch.arange(0, 16 * batch + 1, 16, dtype=torch.int32),
                lengths,
                scale=0.125,
            ),
        }
        for name, fn in cases.items():
            before = _NoOpKernel.launches
            fn()
            launches = _NoOpKernel.launches - before
            direct_us = best_us(fn, calls)
            with direct.through_jit_run():
                jit_us = best_us(fn, calls)
            rows.append([name, launches, f"{direct_us:.1f}", f"{jit_us:.1f}", f"{direct_us / jit_us:.2f}x"])
    return rows


def decode_step_rows(rows: int, steps: int, repeats: int) -> list[list]:
    """A `generate()` decode step's host milliseconds on the negligible model: DynamicCache, PagedCache on sdpa,
    PagedCache on "hf_paged" with its launches stood in."""
    from transformers import DynamicCache

    import hf_paged
    from bench.host_overhead import Decoder, interleaved, negligible_model
    from hf_paged import PagedCache
    from hf_paged.attention.kernels import BACKEND_ENV_VAR, direct

    torch.set_num_threads(1)
    model = negligible_model()
    paged_model = hf_paged.enable(copy.deepcopy(model))
    prompts = torch.randint(1, 128, (rows, 128), generator=torch.Generator().manual_seed(rows))
    saved = os.environ.get(BACKEND_ENV_VAR)

    def on_backend(backend: str, step, jit_run: bool = False):
        """`step` with HF_PAGED_ATTENTION_BACKEND=`backend`: "triton" for the "hf_paged" cache (its attention and
        its store launch as on a GPU), "torch" for the others (the sdpa cache stores with index_copy_); its launches
        through `JITFunction.run` if `jit_run`."""

        def run():
            os.environ[BACKEND_ENV_VAR] = backend
            with direct.through_jit_run() if jit_run else contextlib.nullcontext():
                step()

        return run

    try:
        best: dict[str, float] = {}
        for _ in range(repeats):
            os.environ[BACKEND_ENV_VAR] = "torch"
            decoders = {
                "DynamicCache": Decoder(model, lambda m: DynamicCache(config=m.config), prompts),
                "PagedCache, sdpa": Decoder(model, lambda m: PagedCache(config=m.config), prompts),
            }
            os.environ[BACKEND_ENV_VAR] = "triton"
            stood_in = Decoder(paged_model, lambda m: PagedCache(config=m.config), prompts)
            through_jit = Decoder(paged_model, lambda m: PagedCache(config=m.config), prompts)
            steppers = {name: on_backend("torch", decoder.step) for name, decoder in decoders.items()}
            steppers['PagedCache, "hf_paged" (launches stood in)'] = on_backend("triton", stood_in.step)
            steppers['PagedCache, "hf_paged", launches through JITFunction.run'] = on_backend(
                "triton", through_jit.step, jit_run=True
            )
            medians = interleaved(steppers, steps)
            best = {name: min(best.get(name, float("inf")), value) for name, value in medians.items()}
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV_VAR, None)
        else:
            os.environ[BACKEND_ENV_VAR] = saved
    base = best["DynamicCache"]
    return [[rows, name, f"{value * 1e3:.3f}", f"{value / base:.3f}x"] for name, value in best.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.launch_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="launcher calls per timing loop")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8], help="batch sizes of the decode step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import triton

    stand_in_launches()
    print(f"torch {torch.__version__}, triton {triton.__version__}; launches stood in (no GPU)\n")
    headers = ["launcher", "launches", "host us/call", "through JITFunction.run, us", "direct / JITFunction.run"]
    print(tabulate(launcher_rows(args.calls), headers=headers, tablefmt="github"))
    lines = [line for rows in args.rows for line in decode_step_rows(rows, args.steps, args.repeats)]
    print("\nA generate() decode step on the negligible model (host ms; vs DynamicCache):")
    print(tabulate(lines, headers=["rows", "cache", "ms/step", "vs DynamicCache"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
