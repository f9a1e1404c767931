"""hf_paged/attention/kernels/direct.py: a launcher's direct launch takes the compiled variant Triton's
`JITFunction.run` would take, with the arguments it would pass, over launches that differ in one specialization at a
time (a pointer's alignment, a stride, a dtype, a constexpr, the split count, head_dim, the pool's layout).

The kernels must be Triton's JIT functions, which TRITON_INTERPRET (set by conftest.py) makes them not: the checks
run in a child process, this file run as a script, with Triton's driver and compiles stood in
(`bench.launch_overhead.stand_in_launches`: one no-op kernel object per specialization Triton compiles).
"""

import contextlib
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _misaligned(*shape, dtype):
    """A zero tensor of `shape` whose address is 2 elements past a 16-byte boundary (Triton specializes on it)."""
    import torch

    numel = 1
    for size in shape:
        numel *= size
    return torch.zeros(numel + 2, dtype=dtype)[2:].view(shape)


def _decode_cases():
    import torch

    from hf_paged.attention.kernels import triton_decode

    def case(batch=4, head_dim=64, dtype=torch.bfloat16, layout="head_major", query_layout="projection", **options):
        kv_heads, group, num_blocks, block_size, width = 8, 4, 64, 16, 8
        if layout == "head_major":
            caches = [
                torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3) for _ in "kv"
            ]
        else:
            caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in "kv"]
        heads = kv_heads * group
        if query_layout == "projection":  # [B, 1, H, D] transposed, as a model hands it
            query = torch.zeros(batch, 1, heads, head_dim, dtype=dtype).transpose(1, 2)[:, :, 0]
        elif query_layout == "misaligned":
            query = _misaligned(batch, heads, head_dim, dtype=dtype)
        else:
            query = torch.zeros(batch, head_dim, heads, dtype=dtype).transpose(1, 2)
        tables = (torch.arange(batch * width, dtype=torch.int32) % num_blocks).view(batch, width)
        lengths = torch.full((batch,), width * block_size - 3, dtype=torch.int32)
        launch_options = {key: options.pop(key) for key in ("kv_start", "num_splits") if key in options}
        if "kv_start" in launch_options:
            launch_options["kv_start"] = torch.full((batch,), launch_options["kv_start"], dtype=torch.int32)
        launch = triton_decode.DecodeLaunch(query, *caches, tables, lengths, **launch_options)
        # One output for every call, so that the launches of a case pass the same tensors.
        if options.pop("out", None) == "misaligned":
            options["out"] = _misaligned(*query.shape, dtype=dtype)
        else:
            options["out"] = torch.empty(query.shape, dtype=dtype)
        return lambda: launch(query, *caches, scale=0.125, **options)

    return {
        "decode": case(),
        "decode, misaligned query": case(query_layout="misaligned"),
        "decode, query of other strides": case(query_layout="transposed"),
        "decode, misaligned out": case(out="misaligned"),
        "decode, softcap": case(softcap=30.0),
        "decode, window": case(sliding_window=40),
        "decode, kv_start": case(kv_start=5),
        "decode, 4 splits (a merge)": case(num_splits=4),
        "decode, 4 splits, misaligned out": case(num_splits=4, out="misaligned"),
        "decode, 1 row": case(batch=1, num_splits=2),
        "decode, head_dim 128": case(head_dim=128),
        "decode, head_dim 96, 2 splits": case(head_dim=96, num_splits=2),
        "decode, fp16": case(dtype=torch.float16),
        "decode, fp32": case(dtype=torch.float32),
        "decode, block-major pool": case(layout="block_major"),
    }


def _prefill_cases():
    import torch

    from hf_paged.attention.kernels import triton_prefill

    def case(head_dim=64, dtype=torch.bfloat16, query_layout="projection", **options):
        kv_heads, group, num_blocks, block_size = 8, 4, 64, 16
        caches = [
            torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3) for _ in "kv"
        ]
        heads, new_tokens = kv_heads * group, (5, 20)
        num_tokens = sum(new_tokens)
        if query_layout == "projection":  # [1, T, H, D] of a packed step, as the projection hands it
            query = torch.zeros(1, heads, num_tokens, head_dim, dtype=dtype).transpose(1, 2)[0]
        elif query_layout == "misaligned":
            query = _misaligned(num_tokens, heads, head_dim, dtype=dtype)
        else:  # heads 8 elements apart: a head stride that is no multiple of 16
            query = torch.zeros(num_tokens, heads, head_dim + 8, dtype=dtype)[..., :head_dim]
        tables = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
        cu_seqlens = torch.tensor([0, 5, 25], dtype=torch.int32)
        lengths = torch.tensor([40, 100], dtype=torch.int32)
        if "kv_start" in options:
            options["kv_start"] = torch.tensor([options["kv_start"], 0], dtype=torch.int32)
        if options.pop("sinks", False):
            options["sinks"] = torch.zeros(heads)
        misaligned_out = options.pop("out", None) == "misaligned"
        out = _misaligned(*query.shape, dtype=dtype) if misaligned_out else torch.empty(query.shape, dtype=dtype)
        return functools.partial(
            triton_prefill.paged_prefill_attention_triton,
            query,
            *caches,
            tables,
            cu_seqlens,
            lengths,
            scale=0.125,
            out=out,
            **options,
        )

    return {
        "prefill": case(),
        "prefill, misaligned query": case(query_layout="misaligned"),
        "prefill, query of padded heads": case(query_layout="padded"),
        "prefill, misaligned out": case(out="misaligned"),
        "prefill, softcap": case(softcap=30.0),
        "prefill, window": case(sliding_window=16),
        "prefill, kv_start": case(kv_start=3),
        "prefill, sinks": case(sinks=True),
        "prefill, head_dim 128": case(head_dim=128),
        "prefill, fp32": case(dtype=torch.float32),
    }


def _store_cases():
    import torch

    from hf_paged.attention.kernels import triton_store

    def case(rows=3, q_len=1, head_dim=64, dtype=torch.bfloat16, states="projection", layout="head_major"):
        kv_heads, num_blocks, block_size = 8, 32, 16
        if layout == "head_major":
            caches = [
                torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3) for _ in "kv"
            ]
        else:
            caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in "kv"]
        launch = triton_store.StoreLaunch(*caches)
        if states == "projection":  # [W, q_len, heads, D] transposed, as a model hands it
            key = torch.zeros(rows, q_len, kv_heads, head_dim, dtype=dtype).transpose(1, 2)
        elif states == "padded":  # rows 8 elements apart: a head stride that is no multiple of 16
            key = torch.zeros(rows, q_len, kv_heads, head_dim + 8, dtype=dtype)[..., :head_dim].transpose(1, 2)
        else:
            key = _misaligned(rows, kv_heads, q_len, head_dim, dtype=dtype)
        slots = torch.arange(rows * q_len) * 3
        return lambda: launch(key, key, slots)

    rows = [torch.zeros(4, 8, 64, dtype=torch.bfloat16) for _ in "kv"]
    pool = [torch.zeros(32, 16, 8, 64, dtype=torch.bfloat16) for _ in "kv"]
    return {
        "store": case(),
        "store, misaligned states": case(states="misaligned"),
        "store, padded rows": case(states="padded"),
        "store, 5 tokens a row": case(q_len=5),
        "store, head_dim 128": case(head_dim=128),
        "store, head_dim 256": case(head_dim=256),
        "store, fp32": case(dtype=torch.float32),
        "store, block-major pool": case(layout="block_major"),
        "store_kv_triton": functools.partial(triton_store.store_kv_triton, *rows, *pool, torch.arange(4)),
    }


def _same(a, b) -> bool:
    """The same argument: the same memory, shape, strides and dtype for tensors (a launcher makes fresh views of
    the same tensors at each call), equal values of one type otherwise."""
    if hasattr(a, "data_ptr") and hasattr(b, "data_ptr"):
        return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)
    return type(a) is type(b) and a == b


def check_direct_launches() -> None:
    """In a process without TRITON_INTERPRET: each case's direct launches (the second call, the first having made
    the variant) against the same call through `JITFunction.run`."""
    from triton.runtime.jit import JITFunction

    from bench import launch_overhead

    launch_overhead.stand_in_launches()
    ran: list = []
    launch_overhead._NoOpKernel.run = lambda self, *args: ran.append((self, args))
    jit_runs = []
    jit_run = JITFunction.run

    def counted_run(self, *args, **kwargs):
        jit_runs.append(self)
        return jit_run(self, *args, **kwargs)

    JITFunction.run = counted_run

    from triton import knobs
    from triton.runtime.driver import driver

    from hf_paged.attention.kernels import direct

    def launches(fn, through_jit: bool, stream: int) -> list:
        ran.clear()
        jit_runs.clear()
        driver.active.stream = stream  # a launch must take the current stream, not the one of its first call
        with direct.through_jit_run() if through_jit else contextlib.nullcontext():
            fn()
        return list(ran)

    def with_knob(knob, name, value, fn):
        """`fn` run with Triton's `knob.name` set to `value` (a setting Triton's own key holds)."""

        def run():
            saved = getattr(knob, name)
            setattr(knob, name, value)
            try:
                fn()
            finally:
                setattr(knob, name, saved)

        return run

    cases = {**_decode_cases(), **_prefill_cases(), **_store_cases()}
    cases["decode, Triton's debug setting"] = with_knob(knobs.runtime, "debug", True, cases["decode"])
    cases["store, Triton's instrumentation"] = with_knob(
        knobs.compilation, "instrumentation_mode", "consan", cases["store"]
    )
    variants = {}  # case -> its first launch's variant
    for index, (name, fn) in enumerate(cases.items()):
        launches(fn, through_jit=False, stream=1)  # the first call finds (or compiles) the variant through kernel[grid]
        direct_launches = launches(fn, through_jit=False, stream=100 + index)
        assert not jit_runs, f"{name}: the second call went through JITFunction.run"
        jitted = launches(fn, through_jit=True, stream=100 + index)
        assert len(jit_runs) == len(jitted) > 0, name
        assert len(direct_launches) == len(jitted), f"{name}: {len(direct_launches)} launches direct, {len(jitted)}"
        for (direct_kernel, direct_args), (jit_kernel, jit_args) in zip(direct_launches, jitted):
            assert direct_args[3] == 100 + index, f"{name}: launched on stream {direct_args[3]}"
            assert direct_kernel is jit_kernel, f"{name}: a direct launch took another compiled variant"
            assert len(direct_args) == len(jit_args), name
            different = [i for i, (a, b) in enumerate(zip(direct_args, jit_args)) if not _same(a, b)]
            assert not different, f"{name}: launch arguments {different} differ: {direct_args} / {jit_args}"
        variants[name] = jitted[0][0]
    # Each case differs from the first of its kernel in something Triton specializes on, so a key that missed it
    # would have launched the first case's variant above.
    for kernel, first in (("decode", "decode"), ("prefill", "prefill"), ("store", "store")):
        others = [name for name in variants if name.startswith(kernel) and name != first]
        same = [name for name in others if variants[name] is variants[first] and not _UNSPECIALIZED.get(name)]
        assert not same, f"{same}: the same variant as {first!r}: the case changes nothing Triton specializes on"
        assert all(variants[name] is variants[first] for name in others if _UNSPECIALIZED.get(name)), _UNSPECIALIZED
    print(f"ok: {len(cases)} cases, {len(set(map(id, variants.values())))} variants")


# Cases that change only arguments Triton does not specialize on (`do_not_specialize`, the grid): the first case's
# variant is the right one for them, and the check above says so.
_UNSPECIALIZED = {
    "decode, window": True,
    "decode, kv_start": True,
    "decode, 4 splits (a merge)": True,
    "decode, 1 row": True,
    "prefill, window": True,
    "prefill, kv_start": True,
    "prefill, sinks": True,  # a flag and an fp32 pointer, as the unused one is
    "decode, block-major pool": True,  # strides all multiples of 16 but the last, as the head-major pool's
    "store, block-major pool": True,
    "store, 5 tokens a row": True,  # token rows of the same strides as one token a row's
    "store_kv_triton": True,
}


def test_direct_launches_take_the_variant_and_arguments_of_triton_s_own_launch():
    pytest.importorskip("triton")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("ok:"), result.stdout


if __name__ == "__main__":
    check_direct_launches()
