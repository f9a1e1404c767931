"""The kernel variants the library launches are the ones CI compiles for sm_80 and sm_90 (tests/test_kernel_compile.py).

Triton compiles a variant per pointer argument's dtype and 16-byte alignment: a caller handing a kernel int32 tables
where another hands int64 makes a second variant, compiled on the GPU in the middle of a run and never checked for
spills. So every launch the library makes (PagedCache eagerly and compiled, the Engine's packed step and its decode
runner, on a uniform model and on one of two layer groups whose sliding layers release blocks) must take the
pointers' dtypes and alignments of a launch that `resources.py` drives, kernel by kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import (
    greedy_reference,
    left_padded_batch,
    random_prompts,
    require_triton_on_cpu,
    tiny_engine,
    tiny_model,
)
from transformers.generation import CompileConfig

import hf_paged
from hf_paged import PagedCache
from hf_paged.attention.kernels import launch_config, resources
from hf_paged.attention.kernels.direct import DirectKernel, pointer_keys

pytestmark = pytest.mark.slow


@pytest.fixture
def launches(monkeypatch):
    """The (kernel, pointers) of every launch made while the test runs; the kernels run unless `run` is cleared."""
    recorded, launch = [], DirectKernel.launch
    run = [True]

    def recording(self, grid, key, args, options):
        # what a compiled variant specializes the launch's tensors on: each one's dtype and 16-byte alignment
        recorded.append((self.fn.__name__, pointer_keys(*(arg for arg in args if isinstance(arg, torch.Tensor)))))
        if run[0]:
            launch(self, grid, key, args, options)

    monkeypatch.setattr(DirectKernel, "launch", recording)
    return recorded, run


def _driven(launches) -> dict[str, set]:
    """kernel -> the pointers of the launches `resources.py` drives (recorded, not run)."""
    recorded, run = launches
    run[0] = False
    for _, call in resources._driven_calls():
        call()
    run[0] = True
    driven: dict[str, set] = {}
    for kernel, pointers in recorded:
        driven.setdefault(kernel, set()).add(pointers)
    recorded.clear()
    return driven


def test_every_launch_of_the_library_takes_a_variant_ci_compiles(launches, monkeypatch):
    require_triton_on_cpu()
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
    driven = _driven(launches)
    recorded, _ = launches
    # tables, lengths, kv_start and slots in INDEX_DTYPE, cu_seqlens_q in int32, the rest floats
    dtypes = {dtype for pointers in driven.values() for specs in pointers for dtype, _ in specs}
    assert {dtype for dtype in dtypes if not dtype.is_floating_point} == {launch_config.INDEX_DTYPE, torch.int32}

    # PagedCache eagerly: a left-padded batch (each row's first key), then a second turn over the cached prompt.
    model = hf_paged.enable(copy.deepcopy(tiny_model("llama")), backend="triton")
    input_ids, attention_mask = left_padded_batch(3, 12)
    cache = PagedCache(config=model.config)
    first = model.generate(input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=3, do_sample=False)
    second_mask = torch.cat([attention_mask, torch.ones(3, 3 + 4, dtype=attention_mask.dtype)], dim=1)
    second = torch.cat([first, torch.randint(1, 128, (3, 4), generator=torch.Generator().manual_seed(1))], dim=1)
    model.generate(second, attention_mask=second_mask, cache=cache, max_new_tokens=2, do_sample=False)
    cache.release()
    eager = len(recorded)

    # PagedCache(max_cache_len) compiled (the decode kernel through its custom op).
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    try:
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache=PagedCache(config=model.config, max_cache_len=32),
            max_new_tokens=3,
            do_sample=False,
            compile_config=config,
        )
    finally:
        for attribute in ("_compiled_call", "_last_compile_config"):
            model.__dict__.pop(attribute, None)
    compiled = len(recorded) - eager

    # The Engine: prefill chunks packed beside decode rows, then decode-only steps on its decode runner.
    prompts = random_prompts((13, 22, 5))
    engine, pool = tiny_engine("llama", 64, max_num_seqs=3, max_num_batched_tokens=10)
    assert engine.generate(prompts, max_new_tokens=[4, 6, 3], ignore_eos=True) == greedy_reference(
        "llama", prompts, [4, 6, 3]
    )
    assert engine.runner.stats.eager_steps > 0  # decode-only steps ran on the runner

    # A model of two layer groups, its sliding layers' tables released past their window (each row's first held
    # block moves), eagerly and in the Engine.
    gemma = hf_paged.enable(copy.deepcopy(tiny_model("gemma3")), backend="triton")
    gemma.generate(input_ids, attention_mask=attention_mask, cache=PagedCache(config=gemma.config), max_new_tokens=6)
    engine, pool = tiny_engine("gemma3", 64, max_num_seqs=3, max_num_batched_tokens=10)
    assert engine.generate(prompts, max_new_tokens=[5, 12, 6], ignore_eos=True) == greedy_reference(
        "gemma3", prompts, [5, 12, 6]
    )

    assert eager and compiled and len(recorded) > eager + compiled
    kernels = {kernel for kernel, _ in recorded}
    assert {"_paged_decode_kernel", "_paged_prefill_kernel", "_store_kv_kernel"} <= kernels
    outside = sorted({(kernel, pointers) for kernel, pointers in recorded if pointers not in driven.get(kernel, ())})
    assert not outside, f"launches whose pointers no variant CI compiles has: {outside}"
