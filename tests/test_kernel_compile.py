"""Every Triton kernel variant the launchers pick compiles for sm_80 and sm_90 without register spills, on a machine
without a GPU.

`hf_paged.attention.kernels.resources` drives the real launchers over the supported dtypes, head dims, GQA groups,
block sizes, split counts and options with Triton's launches recorded instead of run, compiles each distinct launch
for both targets with the ptxas bundled in the triton wheel, and reads registers, spills and shared memory from the
cubin. One subprocess for the whole module (the kernels must be real JIT functions, and conftest.py has set
TRITON_INTERPRET here); Triton's cache makes reruns fast. docs/kernels.md shows the same numbers per variant
(`python -m bench.kernel_resources`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hf_paged.attention.kernels import launch_config, resources  # noqa: E402

pytestmark = pytest.mark.slow
CAPABILITIES = launch_config.CHECKED_CAPABILITIES


def _describe(variant: dict) -> str:
    return (
        f"{variant['kernel']} sm_{variant['capability']} {variant['dtypes']} {variant['constexprs']} "
        f"num_warps={variant['num_warps']} num_stages={variant['num_stages']} (first picked by: {variant['example']})"
    )


@pytest.fixture(scope="module")
def variants() -> list[dict]:
    if resources.nvidia_tools() is None:
        pytest.skip("ptxas or cuobjdump not found in the triton wheel (triton/backends/nvidia/bin)")
    return resources.measure_in_subprocess()["variants"]


def test_every_kernel_is_launched_for_every_target(variants):
    seen = {(v["kernel"], v["capability"]) for v in variants}
    assert seen == {(kernel, capability) for kernel in resources.KERNEL_NAMES for capability in CAPABILITIES}


def test_every_variant_compiles(variants):
    failed = [f"{_describe(v)}:\n{v['error']}" for v in variants if v["error"]]
    assert not failed, "\n\n".join(failed)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_no_variant_spills_registers(variants, capability):
    spilling = [
        f"{_describe(v)}: {v['registers']} registers, {v['stack_bytes']} bytes of stack, {v['local_bytes']} local"
        for v in variants
        if v["capability"] == capability and not v["error"] and (v["stack_bytes"] or v["local_bytes"])
    ]
    assert not spilling, "register spills:\n" + "\n".join(spilling)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_shared_memory_fits_a_block(variants, capability):
    limit = resources.ARCH_LIMITS[capability]["shared_per_block"]
    too_big = [
        f"{_describe(v)}: {v['shared_bytes']} bytes > {limit}"
        for v in variants
        if v["capability"] == capability and not v["error"] and v["shared_bytes"] > limit
    ]
    assert not too_big, "\n".join(too_big)


def test_runtime_sizes_add_no_variants(variants):
    """GQA group, block size, window, kv_start and split count are runtime arguments: the decode kernel compiles
    once per (dtype, head_dim tile, softcap) and target, whatever model or step launches it, and once more where the
    block size is not a power of two (the general addressing, driven at `GENERAL_HEAD_DIMS`)."""
    decode = [v for v in variants if v["kernel"] == "_paged_decode_kernel"]
    slots = [v for v in decode if v["constexprs"]["SLOT_ROWS"]]
    num_tiles = len({launch_config.head_dim_pad(d) for d in resources.HEAD_DIMS})
    assert len(slots) == len(CAPABILITIES) * len(resources.DTYPES) * num_tiles * 2
    general = [v for v in decode if not v["constexprs"]["SLOT_ROWS"]]
    assert len(general) == len(CAPABILITIES) * len(resources.DTYPES) * len(resources.GENERAL_HEAD_DIMS) * 2
    prefill = [v for v in variants if v["kernel"] == "_paged_prefill_kernel"]
    assert {v["constexprs"]["HEAD_DIM_PAD"] for v in prefill if not v["constexprs"]["SLOT_ROWS"]} == {64, 128, 256}
