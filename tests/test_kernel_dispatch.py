"""Choosing the paged-decode backend (argument, environment variable, what is installed), dispatch to it, and
compiling the Triton kernels for GPU targets on a machine without one."""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged.attention.kernels import paged_decode_attention, resolve_backend
from tests.test_kernels import CAN_RUN_TRITON, HAS_TRITON, make_batch


# ------------------------------------------------------------------ backend switch
def test_backend_argument_and_env_var(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    assert resolve_backend(None, cpu) == "torch"
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cuda) == "torch"
    if HAS_TRITON:
        assert resolve_backend("auto", cuda) == "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_backend("triton", cpu) == "triton"
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "torch")
    assert resolve_backend(None, cuda) == "torch"
    assert resolve_backend("auto", cpu) == "torch"  # an explicit argument wins over the variable
    if HAS_TRITON:
        monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "triton")
        assert resolve_backend(None, cpu) == "triton"


def test_store_backend_is_resolved_like_the_kernels(monkeypatch):
    from hf_paged.attention import store_backend, store_kv_rows

    cpu = torch.device("cpu")
    monkeypatch.delenv("HF_PAGED_ATTENTION_BACKEND", raising=False)
    assert store_backend(cpu) == "torch"
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "torch")
    assert store_backend(torch.device("cuda")) == "torch"
    cache = torch.zeros(2, 4, 2, 8)  # [kv_heads, blocks, block_size, head_dim]
    states = torch.randn(1, 2, 3, 8)
    store_kv_rows(cache, cache.clone(), states, states, torch.tensor([0, 5, 7]), backend="torch")
    assert torch.equal(cache[:, 2, 1], states[0, :, 1])  # slot 5 = block 2, offset 1
    with pytest.raises(ValueError, match=r"backend must be None, 'triton' or 'torch' .*got 'auto'"):
        store_kv_rows(cache, cache.clone(), states, states, torch.tensor([0, 5, 7]), backend="auto")


def test_backend_bad_values(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'triton', 'torch', got 'cuda'"):
        resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"HF_PAGED_ATTENTION_BACKEND must be one of .*'torch', got 'flash'"):
        resolve_backend(None, torch.device("cpu"))
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            resolve_backend("triton", torch.device("cpu"))


def test_backend_triton_not_installed(monkeypatch):
    import hf_paged.attention.kernels.dispatch as dispatch

    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="triton is not installed"):
        resolve_backend("triton", torch.device("cuda"))


def test_dispatch_calls_the_chosen_backend(monkeypatch):
    if not CAN_RUN_TRITON:
        pytest.skip("triton not installed, or no CUDA and TRITON_INTERPRET is not 1")
    import hf_paged.attention.kernels.dispatch as dispatch
    import hf_paged.attention.kernels.triton_decode as triton_decode

    calls = []
    monkeypatch.setattr(dispatch, "paged_decode_attention_torch", lambda *a, **k: calls.append("torch"))
    monkeypatch.setattr(triton_decode, "paged_decode_attention_triton", lambda *a, **k: calls.append("triton"))
    batch = make_batch([3], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    for env in ("torch", "triton"):
        monkeypatch.setenv("HF_PAGED_ATTENTION_BACKEND", env)
        paged_decode_attention(*batch.args, scale=1.0)
    paged_decode_attention(*batch.args, scale=1.0, backend="torch")
    assert calls == ["torch", "triton", "torch"]


# ------------------------------------------------------------------ GPU compilation, without a GPU
COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_paged.attention.kernels import triton_decode, triton_store

def compile(fn, arch, ptr_types, constexprs, **options):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + ptr_types.get(name, ptr_types["default"])
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
    # strides of 1 as constexprs, as Triton's launcher specializes them: the kernels' real, vectorized form
    constexprs = {**constexprs, **{n: 1 for n in fn.arg_names if n.startswith("stride") and n.endswith("d")}}
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)

decode = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=4,
              HAS_KV_START=True, USE_SLIDING_WINDOW=True, USE_SOFTCAP=True, DOT_PRECISION="tf32", DOT_UPCAST=False)
int_ptrs = dict(block_tables_ptr="i32", seq_lens_ptr="i32", kv_start_ptr="i32")
compile(triton_decode._paged_decode_kernel, 90, dict(default="bf16", partial_out_ptr="fp32", partial_lse_ptr="fp32",
        **int_ptrs), decode, num_warps=4, num_stages=2)
decode.update(GROUP=1, HEAD_DIM=256, HEAD_DIM_PAD=256, BLOCK_N=32, NUM_SPLITS=1, HAS_KV_START=False,
              USE_SLIDING_WINDOW=False, USE_SOFTCAP=False, DOT_PRECISION="ieee")
compile(triton_decode._paged_decode_kernel, 80, dict(default="fp32", **int_ptrs), decode, num_warps=4, num_stages=2)
compile(triton_decode._merge_splits_kernel, 90, dict(default="fp32", out_ptr="fp16"),
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=33, SPLITS_PAD=64), num_warps=4)
compile(triton_store._store_kv_kernel, 90, dict(default="bf16", slot_mapping_ptr="i64"),
        dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128), num_warps=1)
print("compiled")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_kernels_compile_for_gpu(tmp_path):
    """Compile the kernels to sm_90 / sm_80 cubins with the ptxas bundled in the triton wheel: catches what the CPU
    interpreter lets through (dot shapes, dtypes, constexpr misuse) on machines without a GPU."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)  # real JIT functions, not interpreted ones
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
